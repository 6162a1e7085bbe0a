// C++ unit tests of libspecrt's pieces (ctest "unit"): the sampling filter, verification's
// distribution, the n-gram matcher, the proposer factory, manifest errors through the C ABI, and, when
// SPECRT_TEST_ENGINE names an engine dir, greedy speculative == plain greedy on it; with
// SPECRT_TEST_KERNEL_MODEL=IN.onnx SPECRT_TEST_KERNEL_OUT=OUT.onnx, the graph the kernels run (compared with the
// Python runtime's in tests/runtime/cpp/test_cpp_kernel_graph.py).
// The comparisons with the Python runtime live in tests/cpp (pytest, through the C ABI).
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "error.h"
#include "gamma_policy.h"
#include "kernel_attention.h"
#include "ngram.h"
#include "proposer.h"
#include "sampling.h"
#include "suffix.h"
#include "specrt.hpp"
#include "verify.h"

using namespace specrt::impl;

namespace {

int failures = 0;

#define CHECK(cond)                                                        \
  do {                                                                     \
    if (!(cond)) {                                                         \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                          \
    }                                                                      \
  } while (0)

bool near(double a, double b, double tol = 1e-9) { return std::fabs(a - b) <= tol; }

std::vector<float> logits_of(const std::vector<double> &p) {  // logits whose softmax is p
  std::vector<float> out;
  for (double x : p) out.push_back(x > 0 ? static_cast<float>(std::log(x)) : -1e30f);
  return out;
}

void test_probs() {
  std::vector<double> p;
  std::vector<float> x = {1.0f, 3.0f, 3.0f, -2.0f};
  probs(x.data(), 4, Sampling{}, p);  // greedy: one-hot on the lowest argmax
  CHECK(p[1] == 1.0 && p[2] == 0.0);
  auto l = logits_of({0.5, 0.3, 0.2});
  probs(l.data(), 3, Sampling{1.0, 0, 0.6, 0.0}, p);  // top-p 0.6 keeps {0, 1}: the mass before token 2 is 0.8
  CHECK(near(p[0], 0.625, 1e-6) && near(p[1], 0.375, 1e-6) && p[2] == 0.0);
  auto t = logits_of({0.4, 0.3, 0.3});
  probs(t.data(), 3, Sampling{1.0, 2, 1.0, 0.0}, p);  // top-k 2 keeps ties at the boundary
  CHECK(p[0] > 0 && p[1] > 0 && p[2] > 0);
  probs(t.data(), 3, Sampling{1.0, 0, 0.5, 0.0}, p);  // top-p 0.5: ties strictly after 0.4 both kept
  CHECK(p[1] > 0 && p[2] > 0 && near(p[1], p[2]));
  probs(l.data(), 3, Sampling{1.0, 0, 1.0, 0.5}, p);  // min-p 0.5: keep >= 0.25
  CHECK(p[2] == 0.0 && near(p[0], 0.625, 1e-6));
  std::vector<float> big = {1e30f, 0.0f};
  probs(big.data(), 2, Sampling{1e-300, 0, 1.0, 0.0}, p);  // a tiny temperature does not overflow
  CHECK(p[0] == 1.0 && std::isfinite(p[1]));
  CHECK(check_sampling(Sampling{-1.0, 0, 1.0, 0.0}) == "temperature must be a finite number >= 0, got -1.0");
  CHECK(check_sampling(Sampling{1.0, 0, 0.0, 0.0}) == "top_p must be in (0, 1], got 0.0");
}

// Verification emits tokens distributed as p whatever q is: empirical frequencies of the first emitted token.
void test_verify_distribution() {
  const int V = 4, trials = 200000;
  std::vector<double> pt = {0.1, 0.4, 0.2, 0.3}, qd = {0.5, 0.1, 0.3, 0.1};
  auto lp = logits_of(pt);
  std::vector<float> logits;
  for (int r = 0; r < 2; ++r) logits.insert(logits.end(), lp.begin(), lp.end());  // rows: after the root, after x1
  for (bool point_mass : {false, true}) {
    Rng rng(7);
    std::vector<double> counts(V), scratch;
    for (int n = 0; n < trials; ++n) {
      int64_t x = point_mass ? 0 : sample(qd.data(), V, rng);
      std::vector<double> q = point_mass ? std::vector<double>{} : qd;
      Verdict v = verify_sampled({x}, q, logits.data(), V, Sampling{1.0, 0, 1.0, 0.0}, rng, scratch);
      counts[v.accepted ? x : v.next] += 1;
    }
    for (int t = 0; t < V; ++t) CHECK(near(counts[t] / trials, pt[t], 0.006));
  }
  Verdict g = verify_greedy({1}, logits.data(), V);  // the argmax is 1 at both rows: x1 = 1 kept, then the bonus 1
  CHECK(g.accepted == 1 && g.next == 1);
  g = verify_greedy({2}, logits.data(), V);
  CHECK(g.accepted == 0 && g.next == 1);
}

std::vector<uint64_t> hashes_of(const std::vector<int64_t> &t) {  // the context hashes of all of t
  std::vector<uint64_t> h;
  context_hashes(t.data(), t.size(), 3, h);
  return h;
}

void test_suffix() {  // the worked example of suffix_index.h
  SuffixCache cache(3, 100);
  cache.add({7, 1, 2, 3, 4});
  SuffixIndex local(3);
  std::vector<int64_t> seq = {9, 1, 2};
  local.add(seq, 0, seq.size());
  CHECK((suffix_propose(local, {&cache.index}, seq.data(), seq.size(), 5) == std::vector<int64_t>{3, 4}));
  SuffixCache small(3, 6);  // room for 6 tokens: the next sequence evicts the first
  small.add({7, 1, 2, 3, 4});
  small.add({5, 5, 5});
  CHECK(small.index.longest(hashes_of({1, 2})).first == 0 && small.index.longest(hashes_of({5})).first == 1);
  CHECK(cache.index.longest(hashes_of({9, 1, 2})).first == 2);  // [1, 2] seen, [9, 1, 2] not
  SuffixIndex a(3), b(3), both(3);  // merging counts what adding the other's sequences again would
  std::vector<int64_t> x = {1, 2, 3, 1, 2, 4}, y = {2, 3, 1, 2, 4, 4};
  a.add(x, 0, x.size());
  b.add(y, 0, y.size());
  both.add(x, 0, x.size());
  both.add(y, 0, y.size());
  a.merge(b);
  CHECK(a.contexts() == both.contexts());
  auto counts = [](CountsView v) { return SuffixIndex::Counts(v.begin(), v.end()); };
  CHECK(counts(a.longest(hashes_of({1, 2})).second) == counts(both.longest(hashes_of({1, 2})).second));
  CHECK((counts(a.longest(hashes_of({1, 2})).second) == SuffixIndex::Counts{{3, 1}, {4, 2}}));
  for (int round = 0; round < 2; ++round) a.add(x, 0, x.size(), -1), a.add(y, 0, y.size(), -1);
  CHECK(a.contexts() == 0);  // all uncounted (the second round finds nothing left to uncount)
}

void test_ngram() {
  NGramIndex index(3, 1);
  index.extend({5, 1, 2, 3, 9, 1, 2});
  CHECK((index.propose(3) == std::vector<int64_t>{3, 9, 1}));
  index.extend({5, 1, 2, 3, 9, 1, 2, 7});
  CHECK(index.propose(2).empty());
}

std::string method_error(const std::string &method, LatencyCurve &curve, SuffixCache &cache) {  // "" if none
  try {
    make_proposer(method, nullptr, curve, cache);
  } catch (const ArgumentError &e) {
    return e.what();
  }
  return "";
}

void test_proposer_factory() {  // one proposer per method, through the interface only
  LatencyCurve curve(1);
  SuffixCache cache(3, 100);
  cache.add({7, 1, 2, 3, 4});
  for (const char *method : {"none", "ngram", "suffix"})
    CHECK(std::string(make_proposer(method, nullptr, curve, cache)->name()) == method);
  CHECK(!make_proposer("none", nullptr, curve, cache)->proposes());
  Rng rng(0);
  Proposal p;
  std::vector<int64_t> seq = {5, 1, 2, 3, 9, 1, 2};
  make_proposer("ngram", nullptr, curve, cache)->propose(seq, 3, Sampling{}, rng, p);
  CHECK((p.tokens == std::vector<int64_t>{3, 9, 1}) && p.q.empty());
  auto suffix = make_proposer("suffix", nullptr, curve, cache);
  seq = {9, 1, 2};
  suffix->start(seq);
  suffix->propose(seq, 5, Sampling{}, rng, p);  // the worked example of suffix_index.h
  CHECK((p.tokens == std::vector<int64_t>{3, 4}));
  suffix->finish({9, 1, 2, 8, 6});  // the finished sequence joins the engine's cache
  CHECK(cache.index.longest(hashes_of({8})).first == 1);
  CHECK(method_error("draft", curve, cache) == "method 'draft' needs an engine dir exported with --draft");
  CHECK(method_error("eagle", curve, cache) ==
        "method 'eagle' is not in the C++ runtime (it runs none, draft, ngram, suffix); pass one of those");
  CHECK(method_error("beam", curve, cache) == "unknown method 'beam'; available: none, draft, ngram, suffix");
}

void test_gamma_policy() {
  LatencyCurve flat(5), linear(5);
  for (int q = 1; q <= 5; ++q) flat.record(q, 1e-3), linear.record(q, q * 1e-3);
  LatencyCurve noisy(3);
  noisy.record(1, 2e-3), noisy.record(2, 1e-3), noisy.record(3, 4e-3);  // a cheaper Q = 2 is noise: pooled
  CHECK(near(noisy.seconds(1), 1.5e-3) && near(noisy.seconds(2), 1.5e-3) && near(noisy.seconds(3), 4e-3));
  CHECK(near(expected_tokens(0.5, 2), 1.75) && near(expected_tokens(1.0, 3), 4.0));
  GammaPolicy high(4, 8), low(4, 8);
  CHECK(high.decide(0.9, flat, 0.0) == 4);  // verification free, acceptance high: the longest chain
  CHECK(high.decide(0.9, flat, 1e-3) < 4);  // a draft step as dear as a target pass: shorter
  int probes = 0;
  for (int round = 0; round < 16; ++round) probes += low.decide(0.5, linear, 0.0);  // Q positions cost Q passes: off
  CHECK(probes == 2);  // but every 8th round probes at γ = 1
  LatencyCurve narrow(2);
  narrow.record(1, 1e-3), narrow.record(2, 1.4e-3);
  GammaPolicy one(1, 8);
  CHECK(one.decide(0.5, narrow, 0.0) == 0);  // 1.5 / 1.4 = 1.07x plain: under kMinGain
  CHECK(one.decide(0.7, narrow, 0.0) == 1);  // 1.7 / 1.4 = 1.21x
}

std::string temp_dir() {
  char tmpl[] = "/tmp/specrt_unit_XXXXXX";
  return mkdtemp(tmpl);
}

std::string open_error(const std::string &dir) {
  specrt_engine *e = nullptr;
  specrt_status s = specrt_engine_open(dir.c_str(), nullptr, &e);
  CHECK(s == SPECRT_ERROR_ENGINE && e == nullptr);
  return specrt_last_error();
}

void test_manifest_errors() {
  const std::string dir = temp_dir();
  CHECK(open_error(dir + "/nope") == "engine dir " + dir + "/nope does not exist or is not a directory");
  CHECK(open_error(dir) == "engine dir " + dir + " has no manifest.json (export one with `specrt export`)");
  auto write = [&](const std::string &text) { std::ofstream(dir + "/manifest.json") << text; };
  write("{ not json");
  CHECK(open_error(dir).rfind(dir + "/manifest.json is not valid JSON: ", 0) == 0);
  write("{\"format\": \"other\"}");
  CHECK(open_error(dir) == dir + "/manifest.json is not a specrt engine manifest (format != 'specrt-engine')");
  write("{\"format\": \"specrt-engine\", \"schema_version\": 99}");
  CHECK(open_error(dir) == dir + "/manifest.json: schema_version 99 is not supported by this specrt (supports 1, 2); "
                              "re-export the engine or upgrade specrt");
  write("{\"format\": \"specrt-engine\", \"schema_version\": 2, \"models\": {\"target\": {\"file\": \"t.onnx\"}}}");
  CHECK(open_error(dir) == "manifest.json: missing field models.target.'architecture'");
  write("{\"format\": \"specrt-engine\", \"schema_version\": 2, \"models\": {\"target\": {}, \"critic\": {}}}");
  CHECK(open_error(dir) == dir + "/manifest.json: unknown model roles ['critic']; known: ['target', 'draft']");
}

void test_engine() {  // SPECRT_TEST_ENGINE=DIR: greedy none == ngram == draft, token for token
  const char *dir = std::getenv("SPECRT_TEST_ENGINE");
  if (!dir) {
    std::printf("skip: end-to-end generation (set SPECRT_TEST_ENGINE to an engine dir)\n");
    return;
  }
  specrt::Engine engine(dir);
  specrt::Params p;
  p.max_new_tokens = 48;
  p.method = "none";
  auto plain = engine.generate({1, 5, 9, 1, 5}, p).token_ids;
  for (const char *m : {"ngram", "suffix", "draft"}) {
    p.method = m;
    try {
      CHECK(engine.generate({1, 5, 9, 1, 5}, p).token_ids == plain);
    } catch (const specrt::Error &e) {
      CHECK(std::string(e.what()).find("needs an engine dir exported with --draft") != std::string::npos);
    }
  }
  p.temperature = 0.8;  // the sampled paths: proposals with q, rejections, residuals
  p.top_p = 0.9;
  for (const char *m : {"none", "ngram", "suffix", "draft"}) {
    p.method = m;
    try {
      CHECK(engine.generate({1, 5, 9, 1, 5}, p).token_ids.size() >= 1);
    } catch (const specrt::Error &e) {
      CHECK(std::string(e.what()).find("needs an engine dir exported with --draft") != std::string::npos);
    }
  }
  p.temperature = 0.0;
  int seen = 0;
  p.method = "none";
  auto r = engine.generate({1, 5, 9}, p, [&](int64_t) { return ++seen < 3; });
  CHECK(r.finish_reason == "cancelled" && r.token_ids.size() == 3);
  bool rethrown = false;
  try {
    engine.generate({1, 5, 9}, p, [](int64_t) -> bool { throw std::runtime_error("from the callback"); });
  } catch (const std::runtime_error &e) {
    rethrown = std::string(e.what()) == "from the callback";
  }
  CHECK(rethrown);
  CHECK(!engine.generate({1, 5, 9}, p).token_ids.empty());  // the engine still works
}

void test_kernel_model() {  // SPECRT_TEST_KERNEL_MODEL=IN SPECRT_TEST_KERNEL_OUT=OUT: OUT := the kernels' graph
  const char *in = std::getenv("SPECRT_TEST_KERNEL_MODEL"), *out = std::getenv("SPECRT_TEST_KERNEL_OUT");
  if (!in || !out) {
    std::printf("skip: the kernels' graph (set SPECRT_TEST_KERNEL_MODEL and SPECRT_TEST_KERNEL_OUT)\n");
    return;
  }
  std::ifstream file(in, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  int nodes = 0, matmuls = 0;
  const std::string model = kernel_attention_model(bytes, true, nodes, matmuls);
  CHECK(nodes > 0);
  std::ofstream(out, std::ios::binary) << model;
}

}  // namespace

int main() {
  test_probs();
  test_verify_distribution();
  test_ngram();
  test_gamma_policy();
  test_suffix();
  test_proposer_factory();
  test_manifest_errors();
  test_engine();
  test_kernel_model();
  if (failures) std::fprintf(stderr, "%d check(s) failed\n", failures);
  else std::printf("all checks passed\n");
  return failures ? 1 : 0;
}
