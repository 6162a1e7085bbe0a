// Suffix decoding (runtime/proposers/suffix.py): model-free proposals from the continuations of the
// current context, counted over this request AND the engine's earlier requests (a global index of
// recent finished sequences, bounded in tokens, oldest evicted first). A proposal walks the most
// frequent continuation of the longest context either index has seen and stops when the walk's
// probability drops below min_prob or it reaches factor x the first match's length.
//
// Worked example, depth 3, one earlier sequence [7, 1, 2, 3, 4] in the global index, this request's
// sequence [9, 1, 2]: the longest context with counts is [1, 2] (n = 2) -> 3 (1 of 1); then
// [1, 2, 3] -> 4; then [2, 3, 4] -> nothing: proposal [3, 4] (factor 1: at most 2 tokens).
#pragma once
#include <cstddef>
#include <cstdint>
#include <deque>
#include <unordered_map>
#include <vector>

#include "proposer.h"

namespace specrt::impl {

// The hashes of the last 1..depth tokens of `tokens` (hashes[n - 1]: the last n), each built from
// the end backwards, so one pass gives every context length. 64-bit: a collision could only change a
// proposal, never what is emitted (verification is exact).
std::vector<uint64_t> context_hashes(const std::vector<int64_t> &tokens, size_t end, int depth);

// For every context of 1..depth tokens seen in the added sequences: how often each next token followed it.
class SuffixIndex {
 public:
  using Counts = std::vector<std::pair<int64_t, int>>;  // (next token, count), ascending token ids
  explicit SuffixIndex(int depth) : depth_(depth) {}
  // Count (sign -1: uncount) the next tokens seq[start:stop) after their contexts.
  void add(const std::vector<int64_t> &seq, size_t start, size_t stop, int sign = 1);
  // The longest context with counts among `hashes` (context_hashes of the current context): (n, counts) or (0, nullptr).
  std::pair<int, const Counts *> longest(const std::vector<uint64_t> &hashes) const;
  int depth() const { return depth_; }

 private:
  int depth_;
  std::unordered_map<uint64_t, Counts> next_;  // context hash -> counts
};

// The global index: finished sequences, at most max_tokens tokens in all (oldest evicted).
class SuffixCache {
 public:
  SuffixCache(int depth, size_t max_tokens) : index(depth), max_tokens_(max_tokens) {}
  void add(const std::vector<int64_t> &seq);
  SuffixIndex index;

 private:
  size_t max_tokens_, tokens_ = 0;
  std::deque<std::vector<int64_t>> sequences_;
};

// Up to k tokens after `context`: the most frequent continuation of the longest matched context
// (ties: the request's own index, then the lowest token id).
std::vector<int64_t> suffix_propose(const SuffixIndex &local, const SuffixIndex *shared, const std::vector<int64_t> &context,
                                    int k, double factor = 1.0, double min_prob = 0.1);

// Method "suffix": the request's own index, extended with what each round emitted, and the engine's
// global cache, which the sequence joins when it ends.
class SuffixProposer : public Proposer {
 public:
  explicit SuffixProposer(SuffixCache &cache) : cache_(cache), local_(cache.index.depth()) {}
  const char *name() const override { return "suffix"; }
  bool shadow() const override { return true; }
  void propose(const std::vector<int64_t> &seq, int k, const Sampling &s, Rng &rng, Proposal &out) override;
  void finish(const std::vector<int64_t> &seq) override { cache_.add(seq); }

 private:
  SuffixCache &cache_;  // the engine's recent finished sequences (kept across requests)
  SuffixIndex local_;   // this request's sequence
  size_t indexed_ = 0;  // tokens of the sequence counted in local_
};

}  // namespace specrt::impl
