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

const SuffixIndex::Slot *SuffixIndex::find(uint64_t k) const {
  const size_t mask = slots_.size() - 1;
  for (size_t i = k & mask;; i = (i + 1) & mask) {
    if (slots_[i].key == k) return &slots_[i];
    if (!slots_[i].key) return nullptr;
  }
}

SuffixIndex::Slot &SuffixIndex::find_or_insert(uint64_t k) {
  if (8 * (size_ + 1) > 5 * slots_.size()) grow();
  const size_t mask = slots_.size() - 1;
  size_t i = k & mask;
  for (; slots_[i].key && slots_[i].key != k; i = (i + 1) & mask) {
  }
  if (!slots_[i].key) {
    slots_[i].key = k;
    ++size_;
  }
  return slots_[i];
}

void SuffixIndex::grow() {
  std::vector<Slot> old(slots_.size() * 2);
  old.swap(slots_);
  const size_t mask = slots_.size() - 1;
  for (const Slot &slot : old) {
    if (!slot.key) continue;
    size_t i = slot.key & mask;
    while (slots_[i].key) i = (i + 1) & mask;
    slots_[i] = slot;
  }
}

void SuffixIndex::erase(Slot &slot) {  // backward-shift deletion: later slots of the probe run move up
  if (slot.pooled) {
    pool_[slot.pooled - 1].clear();
    free_.push_back(slot.pooled - 1);
  }
  const size_t mask = slots_.size() - 1;
  size_t hole = &slot - slots_.data();
  for (size_t j = (hole + 1) & mask; slots_[j].key; j = (j + 1) & mask) {
    const size_t home = slots_[j].key & mask;
    const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);  // home in (hole, j]
    if (stays) continue;
    slots_[hole] = slots_[j];
    hole = j;
  }
  slots_[hole] = Slot{};
  --size_;
}

void SuffixIndex::count(Slot &slot, int64_t tok, int delta) {
  if (!slot.pooled) {
    if (slot.one.second == 0 || slot.one.first == tok) {  // new, or its only token again
      if (slot.one.second == 0) slot.one.first = tok;
      if ((slot.one.second += delta) <= 0) erase(slot);
      return;
    }
    if (delta <= 0) return;  // uncounting a token never counted here
    uint32_t at;
    if (free_.empty()) {
      at = static_cast<uint32_t>(pool_.size());
      pool_.emplace_back();
    } else {
      at = free_.back();
      free_.pop_back();
    }
    pool_[at] = slot.one.first < tok ? Counts{slot.one, {tok, 0}} : Counts{{tok, 0}, slot.one};
    slot.pooled = at + 1;
  }
  Counts &counts = pool_[slot.pooled - 1];
  auto it = std::lower_bound(counts.begin(), counts.end(), std::make_pair(tok, 0), by_token);
  if (it == counts.end() || it->first != tok) {
    if (delta <= 0) return;
    it = counts.insert(it, {tok, 0});
  }
  if ((it->second += delta) > 0) return;
  counts.erase(it);
  if (counts.empty()) erase(slot);
}

CountsView SuffixIndex::view(const Slot &slot) const {
  if (slot.pooled) return {pool_[slot.pooled - 1].data(), pool_[slot.pooled - 1].size()};
  return {&slot.one, 1};
}

void SuffixIndex::add(const int64_t *seq, size_t start, size_t stop, int sign) {
  std::vector<uint64_t> hashes;
  hashes.reserve(depth_);
  for (size_t i = std::max<size_t>(1, start); i < stop; ++i) {
    context_hashes(seq, i, depth_, hashes);
    for (uint64_t ctx : hashes) {
      if (sign > 0) {
        count(find_or_insert(key(ctx)), seq[i], sign);
      } else if (const Slot *slot = find(key(ctx))) {
        count(const_cast<Slot &>(*slot), seq[i], sign);
      }
    }
  }
}

void SuffixIndex::merge(const SuffixIndex &other) {
  for (const Slot &theirs : other.slots_) {
    if (!theirs.key) continue;
    for (const auto &[tok, c] : other.view(theirs)) count(find_or_insert(theirs.key), tok, c);
  }
}

std::pair<int, CountsView> SuffixIndex::longest(const std::vector<uint64_t> &hashes) const {
  // A binary search over n: every occurrence of an n-token context also counts its last n - 1 tokens (add counts
  // contexts 1..depth at each position, and uncounts them together), so the suffixes with counts are exactly those
  // up to the longest one: ~log2(depth) lookups instead of up to depth.
  int lo = 0, hi = std::min<int>(depth_, static_cast<int>(hashes.size()));
  CountsView found;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (const Slot *slot = find(key(hashes[mid - 1]))) {
      lo = mid;
      found = view(*slot);
    } else {
      hi = mid - 1;
    }
  }
  return {lo, lo ? found : CountsView{}};
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
    for (const auto &[t, c] : counts) {  // ascending ids: the first maximum is the lowest id
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
