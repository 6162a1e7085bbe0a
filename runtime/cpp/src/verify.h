// Chain verification (runtime/verify.py): one target pass over [last token, x_1..x_k] decides
// how many proposals to keep and the token that follows them.
//
//   accepted token   a proposal x_i the target keeps; accepted tokens are a prefix of the proposal
//   recovered token  emitted at the first rejected position i, sampled from norm(max(0, p_i - q_i))
//   bonus token      all k accepted: one more token sampled from p_k
// A round emits n_accepted + 1 tokens. x_i ~ q_i is kept with probability min(1, p_i(x_i) / q_i(x_i)),
// so every emitted token follows p exactly. A deterministic proposal (n-gram) has q = a point
// mass on x_i: accept with probability p_i(x_i), recover from p_i with x_i removed.
#pragma once
#include <cstdint>
#include <vector>

#include "sampling.h"

namespace specrt::impl {

struct Verdict {
  int accepted;    // n: proposals kept
  int64_t next;    // the recovered or bonus token (greedy: the target's argmax after the kept prefix)
};

// tokens [k]; logits [(k + 1) x vocab], the target at the last token and after each proposal.
Verdict verify_greedy(const std::vector<int64_t> &tokens, const float *logits, int vocab);

// q: [k x vocab] the proposer's distributions, or empty for a deterministic proposal; p: scratch
// [vocab] (the target rows' probs() are computed one at a time, only as far as the walk goes).
Verdict verify_sampled(const std::vector<int64_t> &tokens, const std::vector<double> &q, const float *logits,
                       int vocab, const Sampling &s, Rng &rng, std::vector<double> &p);

}  // namespace specrt::impl
