#include "sampling.h"

#include "exp_kernel.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <numeric>

namespace specrt::impl {
namespace {

void normalise(std::vector<double> &p) {
  double sum = 0;
  for (double x : p) sum += x;
  for (double &x : p) x /= sum;
}

// The smallest probability top-p keeps: sort candidates by probability, most probable first, on a
// growing candidate set (a full sort of the vocabulary only when the kept set needs it).
double top_p_threshold(const std::vector<double> &p, double top_p) {
  const int v = static_cast<int>(p.size());
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

int64_t argmax(const float *logits, int vocab) {
  return std::max_element(logits, logits + vocab) - logits;  // the first maximum: lowest id on ties
}

void probs(const float *logits, int vocab, const Sampling &s, std::vector<double> &p) {
  if (s.greedy()) {
    p.assign(vocab, 0.0);
    p[argmax(logits, vocab)] = 1.0;
    return;
  }
  p.resize(vocab);
  float low, top;  // max first: a tiny temperature cannot overflow
  min_max(logits, vocab, &low, &top);
  const double inv_t = 1.0 / s.temperature;
  double sum = 0;
  if (std::isfinite(low) && std::isfinite(top) && (static_cast<double>(top) - low) * inv_t < 1e30) {
    sum = exp_shifted(logits, vocab, top, static_cast<float>(inv_t), p.data());  // the vectorised loop
  } else {  // huge logits or a tiny temperature: the scalar loop in double
    for (int i = 0; i < vocab; ++i) {
      const double z = (static_cast<double>(logits[i]) - top) * inv_t;
      sum += (p[i] = z < -745.0 ? 0.0 : std::exp(z));
    }
  }
  scale(p.data(), vocab, 1.0 / sum);
  if (s.top_k > 0 && s.top_k < vocab) {
    std::vector<double> sorted(p);
    std::nth_element(sorted.begin(), sorted.begin() + (s.top_k - 1), sorted.end(), std::greater<double>());
    const double kth = sorted[s.top_k - 1];
    for (double &x : p) x = x >= kth ? x : 0.0;
    normalise(p);
  }
  if (s.top_p < 1.0) {
    const double threshold = top_p_threshold(p, s.top_p);
    for (double &x : p) x = x >= threshold ? x : 0.0;
    normalise(p);
  }
  if (s.min_p > 0) {
    const double floor = s.min_p * *std::max_element(p.begin(), p.end());
    for (double &x : p) x = x >= floor ? x : 0.0;
    normalise(p);
  }
}

int64_t sample(const double *p, int vocab, Rng &rng) {
  double total = 0;
  for (int i = 0; i < vocab; ++i) total += p[i];
  const double u = rng.uniform() * total;
  double cdf = 0;
  for (int i = 0; i < vocab; ++i) {
    cdf += p[i];
    if (cdf > u) return i;  // the first index whose cdf exceeds u
  }
  return vocab - 1;
}

int64_t next_token(const float *logits, int vocab, const Sampling &s, Rng &rng, std::vector<double> &scratch) {
  if (s.greedy()) return argmax(logits, vocab);
  probs(logits, vocab, s, scratch);
  return sample(scratch.data(), vocab, rng);
}

}  // namespace specrt::impl
