#include "suffix_index.h"

#include <algorithm>
#include <tuple>

namespace specrt::impl {

namespace {

uint64_t mix(uint64_t h, int64_t token) {  // splitmix64 of the running hash and the next token
  uint64_t z = h ^ (static_cast<uint64_t>(token) + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2));
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

bool by_token(const std::pair<int64_t, int> &a, const std::pair<int64_t, int> &b) { return a.first < b.first; }

}  // namespace

void context_hashes(const int64_t *tokens, size_t end, int depth, std::vector<uint64_t> &hashes) {
  hashes.clear();
  uint64_t h = 0x2545F4914F6CDD1Dull;
  for (size_t n = 1; n <= std::min<size_t>(depth, end); ++n) hashes.push_back(h = mix(h, tokens[end - n]));
}

void SuffixIndex::add(const int64_t *seq, size_t start, size_t stop, int sign) {
  std::vector<uint64_t> hashes;
  hashes.reserve(depth_);
  for (size_t i = std::max<size_t>(1, start); i < stop; ++i) {
    const int64_t tok = seq[i];
    context_hashes(seq, i, depth_, hashes);
    for (uint64_t ctx : hashes) {
      auto found = next_.find(ctx);
      if (found == next_.end()) {
        if (sign > 0) next_.emplace(ctx, Counts{{tok, sign}});
        continue;
      }
      Counts &counts = found->second;
      auto it = std::lower_bound(counts.begin(), counts.end(), std::make_pair(tok, 0), by_token);
      if (it == counts.end() || it->first != tok) {
        if (sign <= 0) continue;
        it = counts.insert(it, {tok, 0});
      }
      it->second += sign;
      if (it->second > 0) continue;
      counts.erase(it);
      if (counts.empty()) next_.erase(found);
    }
  }
}

void SuffixIndex::merge(const SuffixIndex &other) {
  for (const auto &[ctx, theirs] : other.next_) {
    Counts &mine = next_[ctx];
    if (mine.empty()) {
      mine = theirs;
      continue;
    }
    Counts merged;
    merged.reserve(mine.size() + theirs.size());
    auto a = mine.cbegin();
    auto b = theirs.cbegin();
    while (a != mine.cend() || b != theirs.cend()) {
      if (b == theirs.cend() || (a != mine.cend() && a->first < b->first)) {
        merged.push_back(*a++);
      } else if (a == mine.cend() || b->first < a->first) {
        merged.push_back(*b++);
      } else {
        merged.emplace_back(a->first, a->second + b->second);
        ++a, ++b;
      }
    }
    mine.swap(merged);
  }
}

std::pair<int, const SuffixIndex::Counts *> SuffixIndex::longest(const std::vector<uint64_t> &hashes) const {
  // A binary search over n: every occurrence of an n-token context also counts its last n - 1 tokens (add counts
  // contexts 1..depth at each position, and uncounts them together), so the suffixes with counts are exactly those
  // up to the longest one: ~log2(depth) lookups instead of up to depth.
  int lo = 0, hi = std::min<int>(depth_, static_cast<int>(hashes.size()));
  const Counts *found = nullptr;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    auto it = next_.find(hashes[mid - 1]);
    if (it != next_.end() && !it->second.empty()) {
      lo = mid;
      found = &it->second;
    } else {
      hi = mid - 1;
    }
  }
  return {lo, lo ? found : nullptr};
}

void SuffixCache::add(const std::vector<int64_t> &full, const SuffixIndex *counted) {
  if (!max_tokens_ || full.empty()) return;
  const bool whole = full.size() <= max_tokens_;
  std::vector<int64_t> seq(full.end() - std::min(full.size(), max_tokens_), full.end());
  while (!sequences_.empty() && tokens_ + seq.size() > max_tokens_) {
    const auto &old = sequences_.front();
    index.add(old, 0, old.size(), -1);
    tokens_ -= old.size();
    sequences_.pop_front();
  }
  if (counted && whole && counted->depth() == index.depth()) {
    index.merge(*counted);
  } else {
    index.add(seq, 0, seq.size());
  }
  tokens_ += seq.size();
  sequences_.push_back(std::move(seq));
}

std::vector<int64_t> suffix_propose(const SuffixIndex &local, const std::vector<const SuffixIndex *> &others,
                                    const int64_t *context, size_t n_context, int k, double factor, double min_prob) {
  const int depth = local.depth();
  std::vector<int64_t> ctx(context + (n_context - std::min<size_t>(depth, n_context)), context + n_context), out;
  std::vector<uint64_t> hashes;
  double prob = 1.0;
  int limit = k;
  for (int step = 0; step < k; ++step) {
    context_hashes(ctx.data(), ctx.size(), depth, hashes);
    auto [n, counts] = local.longest(hashes);
    for (const SuffixIndex *other : others) {
      auto [n_other, other_counts] = other->longest(hashes);
      if (n_other > n) std::tie(n, counts) = std::make_pair(n_other, other_counts);
    }
    if (!n) break;
    if (out.empty()) limit = std::min(k, std::max(1, static_cast<int>(factor * n)));
    int64_t tok = -1;
    int best = 0, total = 0;
    for (const auto &[t, c] : *counts) {  // ascending ids: the first maximum is the lowest id
      total += c;
      if (c > best) std::tie(tok, best) = std::make_pair(t, c);
    }
    prob *= static_cast<double>(best) / total;
    if (prob < min_prob) break;
    out.push_back(tok);
    ctx.push_back(tok);
    if (static_cast<int>(ctx.size()) > depth) ctx.erase(ctx.begin());
    if (static_cast<int>(out.size()) >= limit) break;
  }
  return out;
}

}  // namespace specrt::impl
