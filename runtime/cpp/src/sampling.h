// Logits -> the sampling distribution, exactly as runtime/sampling.py's probs(): the same function
// for the target's p and the draft's q (speculation is exact only if both are filtered alike).
//
//   temperature  (x - max) / T; T == 0: greedy, a one-hot on the argmax (lowest id on ties)
//   top_k        keep tokens whose probability is >= the k-th largest (ties at the boundary kept)
//   top_p        keep x if the mass of tokens strictly more probable than x is < top_p
//   min_p        keep tokens with probability >= min_p * the largest
// each followed by renormalisation, in this order (HF transformers' warpers).
#pragma once
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace specrt::impl {

struct Sampling {
  double temperature = 0.0;  // 0 = greedy
  int top_k = 0;             // 0 = off
  double top_p = 1.0;        // (0, 1]; 1 = off
  double min_p = 0.0;        // [0, 1); 0 = off
  bool greedy() const { return temperature == 0.0; }
};

// The ArgumentError message for an invalid field, or "" (SamplingParams' checks and messages).
std::string check_sampling(const Sampling &s);

// A request's random stream: 53-bit uniforms in [0, 1) from a 64-bit Mersenne Twister.
class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}
  double uniform() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }

 private:
  std::mt19937_64 engine_;
};

// p = probs(logits[0:vocab]) into out [vocab].
void probs(const float *logits, int vocab, const Sampling &s, double *out);
void probs(const float *logits, int vocab, const Sampling &s, std::vector<double> &out);  // out resized

// One index by inverse CDF from p [vocab] (need not be normalised).
int64_t sample(const double *p, int vocab, Rng &rng);

int64_t argmax(const float *logits, int vocab);

// Greedy: the argmax; else a sample of probs(). scratch: reused buffer.
int64_t next_token(const float *logits, int vocab, const Sampling &s, Rng &rng, std::vector<double> &scratch);

// Python's repr of a float (shortest round trip: -1.0, 0.5, inf).
std::string py_float(double x);

}  // namespace specrt::impl
