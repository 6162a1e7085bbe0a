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
#include <map>
#include <unordered_map>
#include <vector>

namespace specrt::impl {

struct TokensHash {
  size_t operator()(const std::vector<int64_t> &v) const {
    size_t h = v.size();
    for (int64_t x : v) h = h * 1000003u ^ static_cast<size_t>(x);
    return h;
  }
};

// For every context of 1..depth tokens seen in the added sequences: how often each next token followed it.
class SuffixIndex {
 public:
  explicit SuffixIndex(int depth) : depth_(depth) {}
  // Count (sign -1: uncount) the next tokens seq[start:stop) after their contexts.
  void add(const std::vector<int64_t> &seq, size_t start, size_t stop, int sign = 1);
  // The longest suffix of context with counts: (n, its counts by token id), or (0, nullptr).
  std::pair<int, const std::map<int64_t, int> *> longest(const std::vector<int64_t> &context) const;
  int depth() const { return depth_; }

 private:
  int depth_;
  std::unordered_map<std::vector<int64_t>, std::map<int64_t, int>, TokensHash> next_;
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

}  // namespace specrt::impl
