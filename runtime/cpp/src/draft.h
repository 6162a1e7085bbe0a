// Method "draft": a draft model with its own cache (runtime/proposers/draft.py, batch 1).
#pragma once
#include <cstdint>
#include <vector>

#include "gamma_policy.h"
#include "graph.h"
#include "proposer.h"

namespace specrt::impl {

// The draft cache holds a prefix of the sequence: a round first feeds what the draft has not seen
// (the accepted tail and the recovered or bonus token) in ONE call, then one call per further
// proposal. q comes from the same probs() as the target's p and the request's Rng.
class DraftProposer : public Proposer {
 public:
  // graph: the engine's draft graph; step_curve: D, seconds per draft call (the engine's, kept across requests).
  DraftProposer(Graph &graph, LatencyCurve &step_curve) : graph_(graph), step_curve_(step_curve) {}
  const char *name() const override { return "draft"; }
  void start(const std::vector<int64_t> &seq) override;  // prefill the prompt (seq but its last token)
  void propose(const std::vector<int64_t> &seq, int k, const Sampling &s, Rng &rng, Proposal &out) override;
  double step_seconds() const override { return step_curve_.seconds(1); }
  int64_t passes() const override { return passes_; }

 private:
  std::vector<int64_t> unseen(const std::vector<int64_t> &seq);  // roll back to the common prefix; the rest of seq
  void run_chain(const std::vector<int64_t> &seq, int k, const Sampling &s, Rng &rng, Proposal &out);  // k draft steps

  Graph &graph_;
  LatencyCurve &step_curve_;
  std::vector<int64_t> seen_;  // tokens in the draft cache, in order
  int64_t passes_ = 0;         // draft graph calls made by propose
};

}  // namespace specrt::impl
