#include "ngram.h"

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

void NGramProposer::propose(const std::vector<int64_t> &seq, int k, const Sampling &, Rng &, Proposal &out) {
  index_.extend(seq);
  out.tokens = index_.propose(k);
}

}  // namespace specrt::impl
