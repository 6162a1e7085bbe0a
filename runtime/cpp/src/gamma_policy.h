// Adaptive γ at batch 1: the Python runtime's policy (runtime/batch_policy.py, runtime/gamma.py).
// Per round, the γ in 0..γmax with the highest predicted tokens per second (if 1.1x γ = 0's, kMinGain),
//
//   rate(γ) = E(α, γ) / (T(γ+1) + γ·D)      E(α, γ) = (1 - α^(γ+1)) / (1 - α)      rate(0) = 1 / T(1)
//
// T(q): measured seconds of one target pass over q positions (LatencyCurve), D: of one draft step (0
// for model-free proposers), α: the decayed acceptance estimate (AlphaEstimate). While the answer is
// 0, every probe_every-th round runs γ = 1 anyway, so α stays measured (not with probe false: the caller
// measures α otherwise, a lookup proposer's shadow guesses). The choice depends on the
// past only, so every round stays exact (a different γ changes speed, never the distribution).
#pragma once
#include <vector>

namespace specrt::impl {

// Seconds of one call by its size n = 1..max_n: per n an EWMA (decay 0.9; one sample counts at most 2x
// the estimate, so a preempted call does not swing the policy), read back non-decreasing (violations
// pooled: more positions never cost less).
class LatencyCurve {
 public:
  explicit LatencyCurve(int max_n) : ewma_(max_n + 1, -1.0) {}
  void record(int n, double seconds);
  double seconds(int n) const;  // the pooled estimate; n without a measurement: the nearest measured below
  bool measured(int n) const { return n < static_cast<int>(ewma_.size()) && ewma_[n] >= 0; }

 private:
  std::vector<double> ewma_;    // [n] -1: not measured
  mutable std::vector<double> pooled_;
  mutable bool stale_ = true;
};

// α̂ = accepted / (accepted + rejections) over exponentially decayed round counts (runtime/gamma.py).
struct AlphaEstimate {
  double accepted = 0.6, rejected = 0.4;  // the prior: α = 0.6 with the weight of one round
  double alpha() const { return accepted / (accepted + rejected > 1e-9 ? accepted + rejected : 1e-9); }
  void update(int proposed, int n_accepted) {
    if (proposed == 0) return;
    accepted = 0.9 * accepted + n_accepted;
    rejected = 0.9 * rejected + (n_accepted < proposed ? 1.0 : 0.0);
  }
};

double expected_tokens(double alpha, int gamma);  // E[tokens per verify pass]

// The Python policy's MIN_GAIN: speculation runs where its predicted rate beats plain decoding's by this factor.
constexpr double kMinGain = 1.1;

// The γ with the highest predicted rate (ties: the smaller), if it beats γ = 0 by kMinGain; probes after
// probe_every rounds off.
class GammaPolicy {
 public:
  GammaPolicy(int gamma_max, int probe_every) : gamma_max_(gamma_max), probe_every_(probe_every) {}
  int decide(double alpha, const LatencyCurve &target, double draft_seconds, bool probe = true);

 private:
  int gamma_max_, probe_every_, idle_ = 0;
};

}  // namespace specrt::impl
