#pragma once

namespace specrt::impl {

// out[i] = exp((x[i] - top) * inv_t) for i < n (float accuracy); returns their sum.
double exp_shifted(const float *x, int n, float top, float inv_t, double *out);

// The smallest and largest of x[0..n) (n >= 1; NaN-free input).
void min_max(const float *x, int n, float *low, float *high);

// p[i] *= factor.
void scale(double *p, int n, double factor);

}  // namespace specrt::impl
