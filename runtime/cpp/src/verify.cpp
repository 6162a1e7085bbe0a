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
  std::vector<double> row;
  p.assign(static_cast<size_t>(k + 1) * vocab, 0.0);
  for (int i = 0; i <= k; ++i) {
    probs(logits + static_cast<size_t>(i) * vocab, vocab, s, row);
    std::copy(row.begin(), row.end(), p.begin() + static_cast<size_t>(i) * vocab);
  }
  for (int i = 0; i < k; ++i) {
    const double *p_i = p.data() + static_cast<size_t>(i) * vocab;
    const double p_x = p_i[tokens[i]];
    const double q_x = point_mass ? 1.0 : q[static_cast<size_t>(i) * vocab + tokens[i]];
    if (rng.uniform() * q_x < p_x) continue;  // u < p/q without dividing by q
    std::vector<double> residual(p_i, p_i + vocab);
#ifndef SPECRT_WRONG_RULE  // a test build compiles the rule wrong (recover from p itself): the harness must catch it
    if (point_mass) residual[tokens[i]] = 0.0;
    else
      for (int t = 0; t < vocab; ++t) residual[t] = std::max(0.0, residual[t] - q[static_cast<size_t>(i) * vocab + t]);
#endif
    double mass = 0;
    for (double x : residual) mass += x;
    if (mass <= 1e-12) residual.assign(p_i, p_i + vocab);  // p == q up to rounding: rejection had ~0 probability
    return {i, sample(residual.data(), vocab, rng)};        // recovered token
  }
  return {k, sample(p.data() + static_cast<size_t>(k) * vocab, vocab, rng)};  // bonus token
}

}  // namespace specrt::impl
