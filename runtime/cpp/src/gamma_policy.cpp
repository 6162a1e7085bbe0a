#include "gamma_policy.h"

#include <algorithm>
#include <cmath>

namespace specrt::impl {

void LatencyCurve::record(int n, double seconds) {
  if (n < 1 || n >= static_cast<int>(ewma_.size())) return;
  double &e = ewma_[n];
  e = e < 0 ? seconds : 0.9 * e + 0.1 * std::min(seconds, 2.0 * e);
  stale_ = true;
}

double LatencyCurve::seconds(int n) const {
  if (stale_) {  // pool adjacent violators over the measured sizes: a non-decreasing curve
    std::vector<double> value, weight;
    std::vector<int> last;  // per block, the largest n it covers
    for (int i = 1; i < static_cast<int>(ewma_.size()); ++i) {
      if (ewma_[i] < 0) continue;
      value.push_back(ewma_[i]);
      weight.push_back(1.0);
      last.push_back(i);
      while (value.size() > 1 && value[value.size() - 2] > value.back()) {
        const size_t b = value.size() - 1;
        value[b - 1] = (value[b - 1] * weight[b - 1] + value[b] * weight[b]) / (weight[b - 1] + weight[b]);
        weight[b - 1] += weight[b];
        last[b - 1] = last[b];
        value.pop_back(), weight.pop_back(), last.pop_back();
      }
    }
    pooled_.assign(ewma_.size(), -1.0);
    size_t block = 0;
    for (int i = 1; i < static_cast<int>(ewma_.size()) && block < value.size(); ++i) {
      if (i > last[block]) ++block;
      if (block < value.size() && ewma_[i] >= 0) pooled_[i] = value[block];
    }
    stale_ = false;
  }
  for (int i = std::min(n, static_cast<int>(pooled_.size()) - 1); i >= 1; --i)
    if (pooled_[i] >= 0) return pooled_[i];
  return 0.0;
}

double expected_tokens(double alpha, int gamma) {
  if (alpha >= 1.0) return gamma + 1.0;
  return (1.0 - std::pow(alpha, gamma + 1)) / (1.0 - alpha);
}

int GammaPolicy::decide(double alpha, const LatencyCurve &target, double draft_seconds, bool probe) {
  int best = 0;
  const double plain = 1.0 / std::max(target.seconds(1), 1e-12);
  double best_rate = plain;
  for (int g = 1; g <= gamma_max_; ++g) {
    const double rate = expected_tokens(alpha, g) / std::max(target.seconds(g + 1) + g * draft_seconds, 1e-12);
    if (rate > best_rate) best = g, best_rate = rate;
  }
  if (best_rate < kMinGain * plain) best = 0;  // a gain within the noise: plain
  if (best > 0 || gamma_max_ == 0) {
    idle_ = 0;
    return best;
  }
  if (probe && ++idle_ >= probe_every_) {  // off for a while: one round at γ = 1 keeps α measured
    idle_ = 0;
    return 1;
  }
  return 0;
}

}  // namespace specrt::impl
