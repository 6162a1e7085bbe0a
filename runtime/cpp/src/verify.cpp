#include "verify.h"

#include <algorithm>

namespace specrt::impl {

Verdict verify_greedy(const std::vector<int64_t> &tokens, const float *logits, int vocab) {
  const int k = static_cast<int>(tokens.size());
  int n = 0;
  while (n < k && argmax(logits + static_cast<size_t>(n) * vocab, vocab) == tokens[n]) ++n;
  return {n, argmax(logits + static_cast<size_t>(n) * vocab, vocab)};
}

Verdict verify_sampled(const std::vector<int64_t> &tokens, const std::vector<double> &q, const float *logits,
                       int vocab, const Sampling &s, Rng &rng, std::vector<double> &p) {
  const int k = static_cast<int>(tokens.size());
  const bool point_mass = q.empty();
  for (int i = 0; i < k; ++i) {  // p_i is computed only for the rows the walk reaches
    probs(logits + static_cast<size_t>(i) * vocab, vocab, s, p);
    const double p_x = p[tokens[i]];
    const double q_x = point_mass ? 1.0 : q[static_cast<size_t>(i) * vocab + tokens[i]];
    if (rng.uniform() * q_x < p_x) continue;  // u < p/q without dividing by q
    std::vector<double> &residual = p;         // rejected: the residual, in place
#ifndef SPECRT_WRONG_RULE  // a test build compiles the rule wrong (recover from p itself): the harness must catch it
    double mass = 0;
    if (point_mass) {
      mass = 1.0 - residual[tokens[i]];
      residual[tokens[i]] = 0.0;
    } else {
      const double *q_i = q.data() + static_cast<size_t>(i) * vocab;
      for (int t = 0; t < vocab; ++t) mass += (residual[t] = std::max(0.0, residual[t] - q_i[t]));
    }
    if (mass <= 1e-12) probs(logits + static_cast<size_t>(i) * vocab, vocab, s, p);  // p == q up to rounding
#endif
    return {i, sample(residual.data(), vocab, rng)};  // recovered token
  }
  probs(logits + static_cast<size_t>(k) * vocab, vocab, s, p);
  return {k, sample(p.data(), vocab, rng)};  // bonus token
}

}  // namespace specrt::impl
