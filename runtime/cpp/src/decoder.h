// The engine: an engine dir's graphs and the decode loop (propose, verify, accept), batch 1. The
// loop reaches the request's method only through its Proposer (proposer.h), made once per request.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gamma_policy.h"
#include "graph.h"
#include "manifest.h"
#include "proposer.h"
#include "sampling.h"
#include "suffix.h"

namespace specrt::impl {

struct GenerateRequest {
  std::vector<int64_t> prompt;        // 1..max_len-1 ids
  std::string method;                 // "none" | "draft" | "ngram" | "suffix"; "": the engine dir's default
  int gamma = -1;                     // proposal length, 0..manifest gamma; -1: defaults.gamma, else adaptive (gamma_policy.h)
  Sampling sampling;
  uint64_t seed = 0;
  int max_new_tokens = 64;
  std::vector<int64_t> stop_token_ids;  // besides the engine's EOS ids
};

struct Counts {  // the Python runtime's per-sequence stats (runtime/stats.py), plus times
  int64_t target_passes = 0, draft_passes = 0, rounds = 0, proposed = 0, accepted = 0, rejections = 0;
  double wall_seconds = 0, engine_seconds = 0;
};

struct Generation {
  std::vector<int64_t> tokens;  // generated ids (prompt excluded; an EOS or stop id included)
  std::string finish_reason;    // "stop" | "length" | "cancelled"
  Counts counts;
};

// Called per generated token; returns false to stop (finish reason "cancelled").
using TokenCallback = std::function<bool(int64_t)>;

class Engine {
 public:
  struct Options {
    std::string ort_library;  // "" : ort_library_path's default
    int intra_op_threads = 0; // target graph (0: ORT's default); the draft runs on 1
    int spin_duration_us = 20;  // engines/ort.py DEFAULT_SPIN_US; -1: ORT's default
    std::string attention;      // "auto" | "ort" | "specrt"; "": $SPECRT_ATTENTION, else auto (src/kernel_attention.h)
  };
  Engine(const std::string &engine_dir, const Options &options);

  Generation generate(const GenerateRequest &request, const TokenCallback &on_token = nullptr);
  const Manifest &manifest() const { return manifest_; }
  bool target_on_kernel() const { return target_->on_kernel(); }  // its attention on specrt's kernel
  std::string default_method() const;  // defaults.method, else "draft" if there is a draft, else "ngram"

 private:
  void check_request(const GenerateRequest &request) const;  // sampling, max_new_tokens, prompt; throws ArgumentError
  std::unique_ptr<Proposer> make_request_proposer(const std::string &method);  // "": the default; throws ArgumentError
  static constexpr int kAdaptive = -2;  // resolve_gamma's answer for "the policy decides per round"
  int resolve_gamma(int gamma, const Proposer &proposer) const;   // 0..gamma, or kAdaptive
  void calibrate();  // T(q) for the q = 1..gamma+1 not measured yet (adaptive γ)

  Manifest manifest_;
  std::unique_ptr<Graph> target_, draft_;
  std::vector<double> scratch_p_, scratch_row_;  // sampling buffers, reused across calls
  Proposal proposal_;                            // the round's proposal, reused
  Proposal shadow_;                              // a plain round's one-token guess of a lookup proposer, reused
  SuffixCache suffix_cache_{24, 1 << 16};        // method suffix: this engine's recent finished sequences (64K tokens)
  std::vector<int64_t> ids_;                     // the round's target input: the last token and the proposal
  // Adaptive γ (a request with gamma -1 on an engine dir whose defaults.gamma is null), kept across requests:
  LatencyCurve target_curve_{1};  // T(q): seconds of a target pass over q = 1..gamma+1 positions
  LatencyCurve draft_curve_{1};   // D: seconds of one draft call (n = 1; 0 until measured; DraftProposer records it)
  AlphaEstimate served_;          // α over the sequences served: a new sequence starts from it
  GammaPolicy policy_{0, 8};      // probes every 8 rounds off, as the Python runtime's batch-1 core
  int64_t calibration_calls_ = 0;
  double calibration_seconds_ = 0;
};

}  // namespace specrt::impl
