#include "suffix.h"

#include <algorithm>

namespace specrt::impl {

void SuffixIndex::add(const std::vector<int64_t> &seq, size_t start, size_t stop, int sign) {
  for (size_t i = std::max<size_t>(1, start); i < stop; ++i) {
    const int64_t tok = seq[i];
    for (size_t n = 1; n <= std::min<size_t>(depth_, i); ++n) {
      std::vector<int64_t> ctx(seq.begin() + (i - n), seq.begin() + i);
      auto &counts = next_[ctx];
      const int c = counts[tok] + sign;
      if (c > 0) {
        counts[tok] = c;
        continue;
      }
      counts.erase(tok);
      if (counts.empty()) next_.erase(ctx);
    }
  }
}

std::pair<int, const std::map<int64_t, int> *> SuffixIndex::longest(const std::vector<int64_t> &context) const {
  for (int n = std::min<int>(depth_, static_cast<int>(context.size())); n > 0; --n) {
    auto it = next_.find(std::vector<int64_t>(context.end() - n, context.end()));
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
    auto [n, counts] = local.longest(ctx);
    if (shared) {
      auto [n_shared, shared_counts] = shared->longest(ctx);
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

}  // namespace specrt::impl
