// The chain proposers of the C++ runtime: n-gram prompt lookup and a draft model
// (runtime/proposers/ngram.py and draft.py, batch 1).
#pragma once
#include <cstdint>
#include <map>
#include <vector>

#include "graph.h"
#include "sampling.h"

namespace specrt::impl {

// Prompt lookup: what followed the most recent EARLIER occurrence of the longest suffix (max_n down
// to min_n tokens). Worked example, tokens [5, 1, 2, 3, 9, 1, 2], k = 3, max_n = 3: [9, 1, 2] occurs
// nowhere earlier; [1, 2] did, followed by [3, 9, 1] -> propose [3, 9, 1]. O(max_n) per token.
class NGramIndex {
 public:
  explicit NGramIndex(int max_n = 4, int min_n = 1) : max_n_(max_n), min_n_(min_n), last_end_(max_n + 1) {}
  void extend(const std::vector<int64_t> &seq);  // index seq's tokens not seen yet (seq only grows)
  std::vector<int64_t> propose(int k) const;
  size_t size() const { return tokens_.size(); }

 private:
  int max_n_, min_n_;
  std::vector<int64_t> tokens_;
  std::vector<std::map<std::vector<int64_t>, size_t>> last_end_;  // [n] gram -> end of its latest occurrence before the last token
  size_t indexed_ = 0;
};

struct Proposal {
  std::vector<int64_t> tokens;  // x_1..x_k
  std::vector<double> q;        // [k x vocab] the draft's distributions; empty: deterministic (n-gram, greedy)
};

// A draft model with its own cache, which holds a prefix of the sequence: a round first feeds what
// the draft has not seen (the accepted tail and the recovered or bonus token) in ONE call, then one
// call per further proposal. q comes from the same probs() as the target's p and the request's Rng.
class DraftProposer {
 public:
  explicit DraftProposer(Graph &graph) : graph_(graph) {}
  void start(const std::vector<int64_t> &prompt);  // a new sequence: prefill the prompt
  // Up to k tokens after seq into out (reused across rounds: no allocation once warm).
  void propose(const std::vector<int64_t> &seq, int k, const Sampling &s, Rng &rng, Proposal &out);
  int64_t passes = 0;  // draft graph calls made by propose

 private:
  Graph &graph_;
  std::vector<int64_t> seen_;  // tokens in the draft cache, in order
};

}  // namespace specrt::impl
