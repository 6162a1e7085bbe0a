// Suffix decoding (runtime/proposers/suffix.py): model-free proposals from the continuations of the
// current context, counted over this request AND the engine's earlier requests (a global index of
// recent finished sequences, bounded in tokens, oldest evicted first). The index, the cache and the
// proposal walk are custom_ops/suffix_index.{h,cpp}, which the Python runtime builds too.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "proposer.h"
#include "suffix_index.h"

namespace specrt::impl {

// Method "suffix": the request's own index, extended with what each round emitted, and the engine's
// global cache, which the sequence joins when it ends.
class SuffixProposer : public Proposer {
 public:
  explicit SuffixProposer(SuffixCache &cache) : cache_(cache), local_(cache.index.depth()) {}
  const char *name() const override { return "suffix"; }
  bool shadow() const override { return true; }
  void propose(const std::vector<int64_t> &seq, int k, const Sampling &s, Rng &rng, Proposal &out) override;
  void finish(const std::vector<int64_t> &seq) override;

 private:
  SuffixCache &cache_;  // the engine's recent finished sequences (kept across requests)
  SuffixIndex local_;   // this request's sequence
  size_t indexed_ = 0;  // tokens of the sequence counted in local_
};

}  // namespace specrt::impl
