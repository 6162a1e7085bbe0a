// Method "ngram": prompt lookup (runtime/proposers/ngram.py, batch 1).
#pragma once
#include <cstdint>
#include <map>
#include <vector>

#include "proposer.h"

namespace specrt::impl {

// Prompt lookup: what followed the most recent EARLIER occurrence of the longest suffix (max_n down
// to min_n tokens). Worked example, tokens [5, 1, 2, 3, 9, 1, 2], k = 3, max_n = 3: [9, 1, 2] occurs
// nowhere earlier; [1, 2] did, followed by [3, 9, 1] -> propose [3, 9, 1]. O(max_n) per token.
class NGramIndex {
 public:
  explicit NGramIndex(int max_n = 4, int min_n = 1) : max_n_(max_n), min_n_(min_n), last_end_(max_n + 1) {}
  void extend(const std::vector<int64_t> &seq);  // index seq's tokens not seen yet (seq only grows)
  std::vector<int64_t> propose(int k) const;     // up to k tokens after the indexed tokens
  size_t size() const { return tokens_.size(); }  // tokens indexed

 private:
  int max_n_, min_n_;
  std::vector<int64_t> tokens_;
  std::vector<std::map<std::vector<int64_t>, size_t>> last_end_;  // [n] gram -> end of its latest occurrence before the last token
  size_t indexed_ = 0;
};

// The request's own n-gram index, extended with what each round emitted.
class NGramProposer : public Proposer {
 public:
  const char *name() const override { return "ngram"; }
  bool shadow() const override { return true; }
  void propose(const std::vector<int64_t> &seq, int k, const Sampling &s, Rng &rng, Proposal &out) override;

 private:
  NGramIndex index_;  // seq's n-grams (max_n 4, min_n 1)
};

}  // namespace specrt::impl
