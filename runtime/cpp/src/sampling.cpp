#include "sampling.h"

#include "exp_kernel.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <numeric>

namespace specrt::impl {
namespace {

void normalise(double *p, int n) { scale(p, n, 1.0 / total(p, n)); }

// Zero every entry below `floor`, then renormalise.
void keep_at_least(double *p, int n, double floor) {
  for (int i = 0; i < n; ++i) p[i] = p[i] >= floor ? p[i] : 0.0;
  normalise(p, n);
}

// The smallest probability top-p keeps: sort candidates by probability, most probable first, on a
// growing candidate set (a full sort of the vocabulary only when the kept set needs it).
double top_p_threshold(const double *p, int v, double top_p) {
  std::vector<int> order(v);
  std::iota(order.begin(), order.end(), 0);
  auto more = [&](int a, int b) { return p[a] > p[b]; };
  for (int k = std::min(v, 64);; k = std::min(v, 4 * k)) {
    std::partial_sort(order.begin(), order.begin() + k, order.end(), more);
    double before = 0, before_first_equal = 0;  // mass strictly before entry j / before its first equal entry
    int last = 0;
    bool cut = false;
    for (int j = 0; j < k; ++j) {
      if (j == 0 || p[order[j]] != p[order[j - 1]]) before_first_equal = before;
      if (before_first_equal < top_p) last = j;
      else { cut = true; break; }
      before += p[order[j]];
    }
    if (cut || k == v) return p[order[last]];
  }
}

}  // namespace

std::string py_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, x);
  std::string s(buf, r.ptr);
  return s.find_first_of(".e") == std::string::npos ? s + ".0" : s;
}

std::string check_sampling(const Sampling &s) {
  if (!std::isfinite(s.temperature) || s.temperature < 0)
    return "temperature must be a finite number >= 0, got " + py_float(s.temperature);
  if (s.top_k < 0) return "top_k must be an integer >= 0 (0 = off), got " + std::to_string(s.top_k);
  if (!(s.top_p > 0 && s.top_p <= 1)) return "top_p must be in (0, 1], got " + py_float(s.top_p);
  if (!(s.min_p >= 0 && s.min_p < 1)) return "min_p must be in [0, 1), got " + py_float(s.min_p);
  return "";
}

int64_t argmax(const float *logits, int vocab) { return first_argmax(logits, vocab); }

void probs(const float *logits, int vocab, const Sampling &s, double *p) {
  if (s.greedy()) {
    std::fill(p, p + vocab, 0.0);
    p[argmax(logits, vocab)] = 1.0;
    return;
  }
  float low, top;  // max first: a tiny temperature cannot overflow
  min_max(logits, vocab, &low, &top);
  const double inv_t = 1.0 / s.temperature;
  double sum = 0;
  if (std::isfinite(low) && std::isfinite(top) && (static_cast<double>(top) - low) * inv_t < 1e30) {
    sum = exp_shifted(logits, vocab, top, static_cast<float>(inv_t), p);  // the vectorised loop
  } else {  // huge logits or a tiny temperature: the scalar loop in double
    for (int i = 0; i < vocab; ++i) {
      const double z = (static_cast<double>(logits[i]) - top) * inv_t;
      sum += (p[i] = z < -745.0 ? 0.0 : std::exp(z));
    }
  }
  scale(p, vocab, 1.0 / sum);
  if (s.top_k > 0 && s.top_k < vocab) {
    std::vector<double> sorted(p, p + vocab);
    std::nth_element(sorted.begin(), sorted.begin() + (s.top_k - 1), sorted.end(), std::greater<double>());
    keep_at_least(p, vocab, sorted[s.top_k - 1]);
  }
  if (s.top_p < 1.0) keep_at_least(p, vocab, top_p_threshold(p, vocab, s.top_p));
  if (s.min_p > 0) keep_at_least(p, vocab, s.min_p * *std::max_element(p, p + vocab));
}

void probs(const float *logits, int vocab, const Sampling &s, std::vector<double> &p) {
  p.resize(vocab);
  probs(logits, vocab, s, p.data());
}

int64_t sample(const double *p, int vocab, Rng &rng) {
  const double u = rng.uniform() * total(p, vocab);
  return first_cdf_above(p, vocab, u);
}

int64_t next_token(const float *logits, int vocab, const Sampling &s, Rng &rng, std::vector<double> &scratch) {
  if (s.greedy()) return argmax(logits, vocab);
  probs(logits, vocab, s, scratch);
  return sample(scratch.data(), vocab, rng);
}

}  // namespace specrt::impl
