#include "draft.h"

#include <algorithm>

namespace specrt::impl {

void DraftProposer::start(const std::vector<int64_t> &seq) {
  const std::vector<int64_t> prompt(seq.begin(), seq.end() - 1);
  graph_.rollback(0);
  graph_.prefill(prompt);
  seen_ = prompt;
}

void DraftProposer::propose(const std::vector<int64_t> &seq, int k, const Sampling &s, Rng &rng, Proposal &out) {
  if (k < 1) return;
  const double seconds_before = graph_.engine_seconds;
  const int64_t calls_before = graph_.calls;
  run_chain(seq, k, s, rng, out);
  step_curve_.record(1, (graph_.engine_seconds - seconds_before) / std::max<int64_t>(1, graph_.calls - calls_before));
}

std::vector<int64_t> DraftProposer::unseen(const std::vector<int64_t> &seq) {
  size_t n = 0;  // at least the last token stays unseen: the draft needs its logits
  while (n < std::min(seen_.size(), seq.size()) && seen_[n] == seq[n]) ++n;
  n = std::min(n, seq.size() - 1);
  graph_.rollback(static_cast<int>(n));
  seen_.resize(n);
  return std::vector<int64_t>(seq.begin() + n, seq.end());
}

void DraftProposer::run_chain(const std::vector<int64_t> &seq, int k, const Sampling &s, Rng &rng, Proposal &out) {
  std::vector<int64_t> feed = unseen(seq);
  const int vocab = graph_.vocab();
  for (int i = 0; i < k; ++i) {
    const float *logits = graph_.forward(feed.data(), static_cast<int>(feed.size()));
    graph_.commit(static_cast<int>(feed.size()));
    ++passes_;
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
