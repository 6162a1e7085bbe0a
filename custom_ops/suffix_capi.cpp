// The C ABI of suffix_index.h for the Python runtime (custom_ops/suffix.py loads it with ctypes): an index is an
// opaque pointer; token arrays are int64. Built with suffix_index.cpp into libspecrt_suffix.so.
#include <algorithm>
#include <cstring>

#include "suffix_index.h"

using specrt::impl::SuffixIndex;

#define SPECRT_SUFFIX_API extern "C" __attribute__((visibility("default")))

SPECRT_SUFFIX_API void *specrt_suffix_new(int depth) { return new SuffixIndex(depth); }

SPECRT_SUFFIX_API void specrt_suffix_free(void *index) { delete static_cast<SuffixIndex *>(index); }

// Count (sign -1: uncount) tokens[start:n) after their contexts (read from tokens[0:n)).
SPECRT_SUFFIX_API void specrt_suffix_add(void *index, const int64_t *tokens, size_t n, size_t start, int sign) {
  static_cast<SuffixIndex *>(index)->add(tokens, start, n, sign);
}

SPECRT_SUFFIX_API void specrt_suffix_merge(void *index, const void *other) {
  static_cast<SuffixIndex *>(index)->merge(*static_cast<const SuffixIndex *>(other));
}

SPECRT_SUFFIX_API size_t specrt_suffix_contexts(const void *index) {
  return static_cast<const SuffixIndex *>(index)->contexts();
}

// The longest suffix of context[0:n) with counts: returns its length (0: none) and writes up to `cap` of its
// (next token, count) pairs, ascending ids, into tokens / counts, their number into *size.
SPECRT_SUFFIX_API int specrt_suffix_longest(const void *index, const int64_t *context, size_t n, int64_t *tokens,
                                            int32_t *counts, size_t cap, size_t *size) {
  const auto *self = static_cast<const SuffixIndex *>(index);
  std::vector<uint64_t> hashes;
  specrt::impl::context_hashes(context, n, self->depth(), hashes);
  auto [length, found] = self->longest(hashes);
  *size = 0;
  for (size_t i = 0; i < std::min(cap, found.size); ++i, ++*size) {
    tokens[i] = found.data[i].first;
    counts[i] = found.data[i].second;
  }
  return length;
}

// suffix_propose over `local` and others[0:n_others): writes up to k tokens into out, returns how many.
SPECRT_SUFFIX_API size_t specrt_suffix_propose(const void *local, const void *const *others, size_t n_others,
                                               const int64_t *context, size_t n, int k, double factor, double min_prob,
                                               int64_t *out) {
  std::vector<const SuffixIndex *> rest;
  for (size_t i = 0; i < n_others; ++i) rest.push_back(static_cast<const SuffixIndex *>(others[i]));
  const std::vector<int64_t> tokens =
      specrt::impl::suffix_propose(*static_cast<const SuffixIndex *>(local), rest, context, n, k, factor, min_prob);
  std::memcpy(out, tokens.data(), tokens.size() * sizeof(int64_t));
  return tokens.size();
}
