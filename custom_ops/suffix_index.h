// Suffix decoding's index (runtime/proposers/suffix.py has the rule and the reference implementation in Python):
// for every context of 1..depth tokens seen in the added sequences, how often each next token followed it; the
// global cache of recent finished sequences; and the proposal walk. Built into libspecrt (runtime/cpp) and, for
// the Python runtime, into libspecrt_suffix.so (suffix_capi.cpp, custom_ops/__init__.py), so both runtimes run
// this one file.
//
// Worked example, depth 3, one earlier sequence [7, 1, 2, 3, 4] in the global index, this request's sequence
// [9, 1, 2]: the longest context with counts is [1, 2] (n = 2) -> 3 (1 of 1); then [1, 2, 3] -> 4; then
// [2, 3, 4] -> nothing: proposal [3, 4] (factor 1: at most 2 tokens).
#pragma once
#include <cstddef>
#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

namespace specrt::impl {

// The hashes of the last 1..depth tokens before tokens[end] (hashes[n - 1]: the last n), each built from the end
// backwards, so one pass gives every context length. 64-bit: a collision could only change a proposal, never what
// is emitted (verification is exact).
void context_hashes(const int64_t *tokens, size_t end, int depth, std::vector<uint64_t> &hashes);

// The next tokens counted after one context: (token, count) pairs in ascending token ids, viewed in place.
struct CountsView {
  const std::pair<int64_t, int> *data = nullptr;
  size_t size = 0;
  const std::pair<int64_t, int> *begin() const { return data; }
  const std::pair<int64_t, int> *end() const { return data + size; }
};

// For every context of 1..depth tokens seen in the added sequences: how often each next token followed it.
// Storage: an open-addressing table of context hashes (linear probing, backward-shift deletion); a context
// followed by one token so far (most of them) holds it inline, others hold their sorted counts in a pool: a new
// context costs no allocation.
class SuffixIndex {
 public:
  using Counts = std::vector<std::pair<int64_t, int>>;  // (next token, count), ascending token ids
  explicit SuffixIndex(int depth) : depth_(depth), slots_(16) {}
  // Count (sign -1: uncount) the next tokens seq[start:stop) after their contexts (seq[0:stop) is read).
  void add(const int64_t *seq, size_t start, size_t stop, int sign = 1);
  void add(const std::vector<int64_t> &seq, size_t start, size_t stop, int sign = 1) { add(seq.data(), start, stop, sign); }
  // Count everything `other` (of the same depth) counted: as adding its sequences again, without rehashing them.
  void merge(const SuffixIndex &other);
  // The longest context with counts among `hashes` (context_hashes of the current context): (n, its counts) or (0, {}).
  std::pair<int, CountsView> longest(const std::vector<uint64_t> &hashes) const;
  int depth() const { return depth_; }
  size_t contexts() const { return size_; }

 private:
  struct Slot {
    uint64_t key = 0;                  // the context's hash (never 0: see key()); 0 = an empty slot
    std::pair<int64_t, int> one{0, 0};  // the only next token and its count, while pooled == 0
    uint32_t pooled = 0;               // 1 + the index of its counts in pool_ when more than one token followed
  };
  static uint64_t key(uint64_t hash) { return hash ? hash : 1; }
  const Slot *find(uint64_t key) const;
  Slot &find_or_insert(uint64_t key);
  void erase(Slot &slot);
  void grow();
  void count(Slot &slot, int64_t token, int delta);  // delta > 0, or < 0 for a counted token
  CountsView view(const Slot &slot) const;

  int depth_;
  std::vector<Slot> slots_;  // a power of two, at most 5/8 full
  size_t size_ = 0;          // slots in use (contexts)
  std::vector<Counts> pool_;  // counts of contexts followed by more than one token
  std::vector<uint32_t> free_;  // unused pool_ entries
};

// The global index: finished sequences, at most max_tokens tokens in all (oldest evicted).
class SuffixCache {
 public:
  SuffixCache(int depth, size_t max_tokens) : index(depth), max_tokens_(max_tokens) {}
  // Keep seq (its last max_tokens), evicting the oldest sequences to make room. `counted`: an index of exactly
  // seq (the request's own), merged instead of counting seq again.
  void add(const std::vector<int64_t> &seq, const SuffixIndex *counted = nullptr);
  SuffixIndex index;

 private:
  size_t max_tokens_, tokens_ = 0;
  std::deque<std::vector<int64_t>> sequences_;
};

// Up to k tokens after context[0:n): the most frequent continuation of the longest matched context (ties: `local`,
// then `others` in order, then the lowest token id), stopping when the walk's probability (the product of each
// step's count share) drops below min_prob or the proposal reaches factor x the first match's length.
std::vector<int64_t> suffix_propose(const SuffixIndex &local, const std::vector<const SuffixIndex *> &others,
                                    const int64_t *context, size_t n, int k, double factor = 1.0, double min_prob = 0.1);

}  // namespace specrt::impl
