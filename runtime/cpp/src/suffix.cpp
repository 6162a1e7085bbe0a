#include "suffix.h"

namespace specrt::impl {

void SuffixProposer::propose(const std::vector<int64_t> &seq, int k, const Sampling &, Rng &, Proposal &out) {
  local_.add(seq, indexed_, seq.size());
  indexed_ = seq.size();
  out.tokens = suffix_propose(local_, {&cache_.index}, seq.data(), seq.size(), k);
}

void SuffixProposer::finish(const std::vector<int64_t> &seq) {
  local_.add(seq, indexed_, seq.size());  // the tokens since the last proposal
  indexed_ = seq.size();
  cache_.add(seq, &local_);  // merged: the sequence is not hashed again
}

}  // namespace specrt::impl
