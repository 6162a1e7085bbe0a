#include "proposers.h"

#include <algorithm>

namespace specrt::impl {

void NGramIndex::extend(const std::vector<int64_t> &seq) {
  tokens_.insert(tokens_.end(), seq.begin() + tokens_.size(), seq.end());
  const auto &t = tokens_;
  for (size_t end = indexed_ + 1; end < t.size(); ++end)  // grams ending before the last token
    for (int n = min_n_; n <= std::min<int>(max_n_, static_cast<int>(end)); ++n)
      last_end_[n][std::vector<int64_t>(t.begin() + (end - n), t.begin() + end)] = end;
  indexed_ = std::max(indexed_, t.empty() ? 0 : t.size() - 1);
}

std::vector<int64_t> NGramIndex::propose(int k) const {
  const auto &t = tokens_;
  for (int n = std::min<int>(max_n_, static_cast<int>(t.size()) - 1); n >= min_n_; --n) {
    auto it = last_end_[n].find(std::vector<int64_t>(t.end() - n, t.end()));
    if (it != last_end_[n].end()) {
      size_t end = it->second;
      return std::vector<int64_t>(t.begin() + end, t.begin() + std::min(t.size(), end + k));
    }
  }
  return {};
}

void DraftProposer::start(const std::vector<int64_t> &prompt) {
  graph_.rollback(0);
  graph_.prefill(prompt);
  seen_ = prompt;
}

void DraftProposer::propose(const std::vector<int64_t> &seq, int k, const Sampling &s, Rng &rng, Proposal &out) {
  out.tokens.clear();
  out.q.clear();
  if (k < 1) return;
  size_t n = 0;  // roll the draft back to its longest common prefix with seq (at least the last token stays unseen)
  while (n < std::min(seen_.size(), seq.size()) && seen_[n] == seq[n]) ++n;
  n = std::min(n, seq.size() - 1);
  graph_.rollback(static_cast<int>(n));
  seen_.resize(n);
  std::vector<int64_t> feed(seq.begin() + n, seq.end());
  const int vocab = graph_.vocab();
  for (int i = 0; i < k; ++i) {
    const float *logits = graph_.forward(feed.data(), static_cast<int>(feed.size()));
    graph_.commit(static_cast<int>(feed.size()));
    ++passes;
    seen_.insert(seen_.end(), feed.begin(), feed.end());
    const float *last = logits + (feed.size() - 1) * vocab;
    int64_t x;
    if (s.greedy()) {
      x = argmax(last, vocab);
    } else {
      out.q.resize(static_cast<size_t>(i + 1) * vocab);  // capacity kept from earlier rounds
      double *q_i = out.q.data() + static_cast<size_t>(i) * vocab;
      probs(last, vocab, s, q_i);
      x = sample(q_i, vocab, rng);
    }
    out.tokens.push_back(x);
    feed.assign(1, x);
    if (i + 1 < k && graph_.room() < 1) break;  // the draft's cache is full: propose what there is
  }
}

}  // namespace specrt::impl
