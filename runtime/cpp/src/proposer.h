// The proposer interface: cheap guesses of the next tokens, for the target to verify in ONE pass per
// round (runtime/proposers/__init__.py's contract, batch 1). The engine makes one proposer per
// request with make_proposer, before the decode loop, and then calls only this interface:
//
//   start(seq)                     a new sequence: seq = prompt + first token (not called when the
//                                  sequence ends at its first token)
//   propose(seq, k, s, rng, out)   per round with k >= 1: at most k tokens after seq into out
//   finish(seq)                    a started sequence ended (Python's release)
//
// There is no observe: as the Python chain proposers, each reads what the last round kept from seq
// at its next propose (the draft rolls its cache back to its longest common prefix with seq).
// Implementations: none (below, proposer.cpp), draft (draft.h), ngram (ngram.h), suffix (suffix.h).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sampling.h"

namespace specrt::impl {

class Graph;
class LatencyCurve;
class SuffixCache;

struct Proposal {
  std::vector<int64_t> tokens;  // x_1..x_k
  std::vector<double> q;        // [k x vocab] the draft's distributions; empty: deterministic (n-gram, greedy)
};

class Proposer {
 public:
  virtual ~Proposer() = default;
  // The method this proposer runs ("none", "draft", "ngram", "suffix").
  virtual const char *name() const = 0;
  // False when every proposal is empty (method none): the request's γ is 0.
  virtual bool proposes() const { return true; }
  // A new sequence: seq is the prompt and the first generated token.
  virtual void start(const std::vector<int64_t> &seq) { (void)seq; }
  // Up to k >= 1 tokens after seq into out, which arrives empty (its buffers reused across rounds).
  virtual void propose(const std::vector<int64_t> &seq, int k, const Sampling &s, Rng &rng, Proposal &out) = 0;
  // The started sequence ended (finished or cancelled); seq is all of it.
  virtual void finish(const std::vector<int64_t> &seq) { (void)seq; }
  // D for the adaptive γ policy: measured seconds of one proposal step (0: model-free, negligible).
  virtual double step_seconds() const { return 0; }
  // Draft graph calls made so far (the stat draft_passes).
  virtual int64_t passes() const { return 0; }
  // A lookup of no model cost (n-gram, suffix): on a round the policy keeps plain, its one-token guess is
  // scored against the emitted token (hit with probability p(x), what verifying x would accept), so α stays
  // measured without probe rounds.
  virtual bool shadow() const { return false; }
};

// The proposer of `method` (already defaulted), on what the engine lends it for the request:
// draft_graph (null: the engine dir has no draft), the draft's step-time curve and the suffix cache,
// both kept across requests. Throws ArgumentError for an unknown method, medusa or eagle, and draft
// without a draft graph.
std::unique_ptr<Proposer> make_proposer(const std::string &method, Graph *draft_graph, LatencyCurve &draft_step,
                                        SuffixCache &suffix_cache);

}  // namespace specrt::impl
