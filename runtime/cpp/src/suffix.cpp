#include "suffix.h"

#include <algorithm>

namespace specrt::impl {

namespace {

uint64_t mix(uint64_t h, int64_t token) {  // splitmix64 of the running hash and the next token
  uint64_t z = h ^ (static_cast<uint64_t>(token) + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2));
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

std::vector<uint64_t> context_hashes(const std::vector<int64_t> &tokens, size_t end, int depth) {
  std::vector<uint64_t> hashes;
  uint64_t h = 0x2545F4914F6CDD1Dull;
  for (size_t n = 1; n <= std::min<size_t>(depth, end); ++n) hashes.push_back(h = mix(h, tokens[end - n]));
  return hashes;
}

void SuffixIndex::add(const std::vector<int64_t> &seq, size_t start, size_t stop, int sign) {
  for (size_t i = std::max<size_t>(1, start); i < stop; ++i) {
    const int64_t tok = seq[i];
    for (uint64_t ctx : context_hashes(seq, i, depth_)) {
      Counts &counts = next_[ctx];
      auto it = std::lower_bound(counts.begin(), counts.end(), std::make_pair(tok, 0),
                                 [](const auto &a, const auto &b) { return a.first < b.first; });
      if (it == counts.end() || it->first != tok) it = counts.insert(it, {tok, 0});
      it->second += sign;
      if (it->second > 0) continue;
      counts.erase(it);
      if (counts.empty()) next_.erase(ctx);
    }
  }
}

std::pair<int, const SuffixIndex::Counts *> SuffixIndex::longest(const std::vector<uint64_t> &hashes) const {
  for (int n = std::min<int>(depth_, static_cast<int>(hashes.size())); n > 0; --n) {
    auto it = next_.find(hashes[n - 1]);
    if (it != next_.end() && !it->second.empty()) return {n, &it->second};
  }
  return {0, nullptr};
}

void SuffixCache::add(const std::vector<int64_t> &full) {
  if (!max_tokens_ || full.empty()) return;
  std::vector<int64_t> seq(full.end() - std::min(full.size(), max_tokens_), full.end());
  while (!sequences_.empty() && tokens_ + seq.size() > max_tokens_) {
    const auto &old = sequences_.front();
    index.add(old, 0, old.size(), -1);
    tokens_ -= old.size();
    sequences_.pop_front();
  }
  index.add(seq, 0, seq.size());
  tokens_ += seq.size();
  sequences_.push_back(std::move(seq));
}

std::vector<int64_t> suffix_propose(const SuffixIndex &local, const SuffixIndex *shared, const std::vector<int64_t> &context,
                                    int k, double factor, double min_prob) {
  const int depth = local.depth();
  std::vector<int64_t> ctx(context.end() - std::min<size_t>(depth, context.size()), context.end()), out;
  double prob = 1.0;
  int limit = k;
  for (int step = 0; step < k; ++step) {
    const std::vector<uint64_t> hashes = context_hashes(ctx, ctx.size(), depth);
    auto [n, counts] = local.longest(hashes);
    if (shared) {
      auto [n_shared, shared_counts] = shared->longest(hashes);
      if (n_shared > n) std::tie(n, counts) = std::make_pair(n_shared, shared_counts);
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

void SuffixProposer::propose(const std::vector<int64_t> &seq, int k, const Sampling &, Rng &, Proposal &out) {
  local_.add(seq, indexed_, seq.size());
  indexed_ = seq.size();
  out.tokens = suffix_propose(local_, &cache_.index, seq, k);
}

}  // namespace specrt::impl
