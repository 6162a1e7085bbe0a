#include "proposer.h"

#include "draft.h"
#include "error.h"
#include "ngram.h"
#include "suffix.h"

namespace specrt::impl {

namespace {

// Method "none": plain decoding through the same loop (every proposal empty).
class NoProposer : public Proposer {
 public:
  const char *name() const override { return "none"; }
  bool proposes() const override { return false; }
  void propose(const std::vector<int64_t> &, int, const Sampling &, Rng &, Proposal &) override {}
};

}  // namespace

std::unique_ptr<Proposer> make_proposer(const std::string &method, Graph *draft_graph, LatencyCurve &draft_step,
                                        SuffixCache &suffix_cache) {
  if (method == "none") return std::make_unique<NoProposer>();
  if (method == "ngram") return std::make_unique<NGramProposer>();
  if (method == "suffix") return std::make_unique<SuffixProposer>(suffix_cache);
  if (method == "draft") {
    if (!draft_graph) throw ArgumentError("method 'draft' needs an engine dir exported with --draft");
    return std::make_unique<DraftProposer>(*draft_graph, draft_step);
  }
  if (method == "medusa" || method == "eagle")
    throw ArgumentError("method '" + method +
                        "' is not in the C++ runtime (it runs none, draft, ngram, suffix); pass one of those");
  throw ArgumentError("unknown method '" + method + "'; available: none, draft, ngram, suffix");
}

}  // namespace specrt::impl
