#include "decoder.h"

#include <algorithm>
#include <chrono>

#include "error.h"
#include "verify.h"

namespace specrt::impl {

Engine::Engine(const std::string &engine_dir, const Options &options) : manifest_(load_manifest(engine_dir)) {
  Ort::Env &env = ort_env(ort_library_path(options.ort_library));
  target_ = std::make_unique<Graph>(env, manifest_.root, manifest_.target(), manifest_.max_len, options.intra_op_threads,
                                    options.spin_duration_us, options.attention);
  if (const GraphSpec *d = manifest_.draft())  // one thread: a draft step is too small to gain from a pool
    draft_ = std::make_unique<Graph>(env, manifest_.root, *d, manifest_.max_len, 1, options.spin_duration_us,
                                     options.attention);
  target_curve_ = LatencyCurve(manifest_.gamma + 1);
  policy_ = GammaPolicy(manifest_.gamma, 8);
}

static double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Engine::calibrate() {  // per q, the fastest of 3 calls after a warm-up, on the stale entries past the valid ones
  const double engine_before = target_->engine_seconds;
  const int64_t calls_before = target_->calls;
  ids_.assign(manifest_.gamma + 1, 0);
  for (int q = 1; q <= manifest_.gamma + 1 && q < target_->room(); ++q) {
    if (target_curve_.measured(q)) continue;
    double best = 1e30;
    for (int rep = 0; rep < 4; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      target_->forward(ids_.data(), q);  // commits nothing
      if (rep) best = std::min(best, seconds_since(t0));
    }
    target_curve_.record(q, best);
  }
  calibration_seconds_ += target_->engine_seconds - engine_before;  // not the requests' time: kept out of their stats
  calibration_calls_ += target_->calls - calls_before;
}

std::string Engine::default_method() const {
  if (!manifest_.default_method.empty()) return manifest_.default_method;
  return draft_ ? "draft" : "ngram";
}

std::unique_ptr<Proposer> Engine::make_request_proposer(const std::string &method) {
  return make_proposer(method.empty() ? default_method() : method, draft_.get(), draft_curve_, suffix_cache_);
}

int Engine::resolve_gamma(int gamma, const Proposer &proposer) const {
  if (!proposer.proposes()) return 0;
  if (gamma < 0) return manifest_.default_gamma.value_or(kAdaptive);
  if (gamma > manifest_.gamma)
    throw ArgumentError("gamma must be in 0.." + std::to_string(manifest_.gamma) + " (the exported gamma), got " +
                        std::to_string(gamma));
  return gamma;
}

void Engine::check_request(const GenerateRequest &req) const {
  if (std::string problem = check_sampling(req.sampling); !problem.empty()) throw ArgumentError(problem);
  if (req.max_new_tokens < 1)
    throw ArgumentError("max_new_tokens must be an integer >= 1, got " + std::to_string(req.max_new_tokens));
  const int max_len = manifest_.max_len, vocab = target_->vocab();
  const int n_prompt = static_cast<int>(req.prompt.size());
  if (n_prompt < 1 || n_prompt >= max_len)
    throw ArgumentError("prompt length " + std::to_string(n_prompt) + " outside 1.." + std::to_string(max_len - 1));
  for (int64_t id : req.prompt)
    if (id < 0 || id >= vocab) throw ArgumentError("token id " + std::to_string(id) + " outside the vocabulary 0.." + std::to_string(vocab - 1));
}

Generation Engine::generate(const GenerateRequest &req, const TokenCallback &on_token) {
  const auto t0 = std::chrono::steady_clock::now();
  check_request(req);
  const int max_len = manifest_.max_len, vocab = target_->vocab();
  const int n_prompt = static_cast<int>(req.prompt.size());
  const std::unique_ptr<Proposer> proposer = make_request_proposer(req.method);  // chosen once: the loop calls only it
  const int fixed_gamma = resolve_gamma(req.gamma, *proposer);
  const bool adaptive = fixed_gamma == kAdaptive;
  const Sampling &s = req.sampling;
  const double engine_before = target_->engine_seconds + (draft_ ? draft_->engine_seconds : 0) - calibration_seconds_;
  const int64_t target_calls_before = target_->calls - calibration_calls_;

  Generation g;
  Counts &c = g.counts;
  Rng rng(req.seed);
  std::vector<int64_t> seq = req.prompt, end_ids = manifest_.eos_token_ids;
  end_ids.insert(end_ids.end(), req.stop_token_ids.begin(), req.stop_token_ids.end());
  const int limit = std::min(req.max_new_tokens, max_len - n_prompt);
  auto emit = [&](int64_t tok) {  // true when the sequence is finished
    g.tokens.push_back(tok);
    seq.push_back(tok);
    if (on_token && !on_token(tok)) g.finish_reason = "cancelled";
    else if (std::find(end_ids.begin(), end_ids.end(), tok) != end_ids.end()) g.finish_reason = "stop";
    else if (static_cast<int>(g.tokens.size()) >= limit) g.finish_reason = "length";
    return !g.finish_reason.empty();
  };

  target_->rollback(0);
  const float *logits = target_->prefill(req.prompt);
  bool done = emit(next_token(logits, vocab, s, rng, scratch_row_));
  const bool started = !done;  // a sequence that ends at its first token never reaches a proposer
  if (started) proposer->start(seq);
  if (started && adaptive) calibrate();
  AlphaEstimate alpha = served_;
  while (!done) {  // one round: propose k, verify all of them in ONE target pass, keep the accepted prefix
    const int budget = limit - static_cast<int>(g.tokens.size());
    const int room = budget <= 1 ? 0 : std::min(budget - 1, target_->room() - 1);  // proposals this round may hold
    const int gamma = room <= 0  ? 0  // (the policy is not asked: a probe is never spent on a round that cannot draft)
                      : adaptive ? policy_.decide(alpha.alpha(), target_curve_, proposer->step_seconds(),
                                                  !proposer->shadow())  // (lookups: scored by shadow guesses)
                                 : fixed_gamma;
    const int k = std::max(0, std::min(gamma, room));
    Proposal &p = proposal_;  // reused: its buffers keep their capacity across rounds
    p.tokens.clear();
    p.q.clear();
    if (k) proposer->propose(seq, k, s, rng, p);
    shadow_.tokens.clear();
    shadow_.q.clear();
    if (adaptive && !k && room > 0 && proposer->shadow())  // a plain round by the policy's choice
      proposer->propose(seq, 1, s, rng, shadow_);          // (a lookup draws nothing from rng)
    ids_.assign(1, seq.back());
    ids_.insert(ids_.end(), p.tokens.begin(), p.tokens.end());
    const auto t_pass = std::chrono::steady_clock::now();
    logits = target_->forward(ids_.data(), static_cast<int>(ids_.size()));
    if (adaptive) target_curve_.record(static_cast<int>(ids_.size()), seconds_since(t_pass));
    const Verdict v = s.greedy() ? verify_greedy(p.tokens, logits, vocab)
                                 : verify_sampled(p.tokens, p.q, logits, vocab, s, rng, scratch_p_);
    target_->commit(v.accepted + 1);  // the last token and the accepted proposals
    const int proposed = static_cast<int>(p.tokens.size());
    alpha.update(proposed, v.accepted);
    served_.update(proposed, v.accepted);
    if (!shadow_.tokens.empty()) {  // a plain round's guess: one token proposed, accepted iff emitted
      const int hit = v.next == shadow_.tokens[0];
      alpha.update(1, hit);
      served_.update(1, hit);
    }
    c.rounds += 1;
    c.proposed += proposed;
    c.accepted += v.accepted;
    c.rejections += v.accepted < proposed;
    for (int i = 0; i < v.accepted && !done; ++i) done = emit(p.tokens[i]);
    if (!done) done = emit(v.next);
  }
  if (started) proposer->finish(seq);
  c.target_passes = target_->calls - calibration_calls_ - target_calls_before;  // prefill chunks and rounds
  c.draft_passes = proposer->passes();
  c.engine_seconds = target_->engine_seconds + (draft_ ? draft_->engine_seconds : 0) - calibration_seconds_ - engine_before;
  c.wall_seconds = seconds_since(t0);
  return g;
}

}  // namespace specrt::impl
