#pragma once

namespace specrt::impl {

// out[i] = exp((x[i] - top) * inv_t) for i < n (float accuracy); returns their sum.
double exp_shifted(const float *x, int n, float top, float inv_t, double *out);

// The smallest and largest of x[0..n) (n >= 1; NaN-free input).
void min_max(const float *x, int n, float *low, float *high);

// p[i] *= factor.
void scale(double *p, int n, double factor);

// The first index of the largest of x[0..n) (n >= 1): the lowest id on ties.
int first_argmax(const float *x, int n);

// The first index i with p[0] + ... + p[i] > u, else the last with p > 0 (p >= 0; summed in blocks of 64).
int first_cdf_above(const double *p, int n, double u);

// p[0] + ... + p[n-1].
double total(const double *p, int n);

}  // namespace specrt::impl
