// A thin C++ wrapper over the C ABI (specrt.h): RAII engine handle, exceptions, std::vector.
//
//   specrt::Engine engine("engine_dir");
//   specrt::Params params;  params.method = "draft"; params.max_new_tokens = 64;
//   specrt::Result r = engine.generate({1, 5, 9}, params, [](int64_t id) { return true; });
//   // r.token_ids, r.finish_reason ("stop" | "length" | "cancelled"), r.stats
#pragma once
#include <cstdint>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "specrt.h"

namespace specrt {

struct Error : std::runtime_error {
  Error(specrt_status status, const std::string &message) : std::runtime_error(message), status(status) {}
  specrt_status status;  // SPECRT_ERROR_ENGINE | _ARGUMENT | _RUNTIME
};

struct Params {
  std::string method;          // "none" | "draft" | "ngram" | "suffix"; "": the engine dir's default
  int gamma = -1;              // -1: defaults.gamma, else the exported gamma
  double temperature = 0.0;    // 0 = greedy
  int top_k = 0;
  double top_p = 1.0;
  double min_p = 0.0;
  uint64_t seed = 0;
  int max_new_tokens = 64;
  std::vector<int64_t> stop_token_ids;
};

struct Result {
  std::vector<int64_t> token_ids;  // generated ids, prompt excluded
  std::string finish_reason;
  specrt_stats stats;
};

class Engine {
 public:
  explicit Engine(const std::string &engine_dir, const specrt_open_options *options = nullptr) {
    if (specrt_abi_version() != SPECRT_ABI_VERSION)
      throw Error(SPECRT_ERROR_RUNTIME, "libspecrt ABI " + std::to_string(specrt_abi_version()) +
                                            " differs from this header's " + std::to_string(SPECRT_ABI_VERSION));
    check(specrt_engine_open(engine_dir.c_str(), options, &handle_));
  }
  ~Engine() { specrt_engine_close(handle_); }
  Engine(const Engine &) = delete;
  Engine &operator=(const Engine &) = delete;
  Engine(Engine &&other) noexcept : handle_(other.handle_) { other.handle_ = nullptr; }

  int max_len() const { return specrt_engine_max_len(handle_); }
  int vocab_size() const { return specrt_engine_vocab_size(handle_); }
  std::string default_method() const { return specrt_engine_default_method(handle_); }
  std::string attention() const { return specrt_engine_attention(handle_); }  // "specrt" | "ort"

  // on_token: called per generated token; return false to stop. An exception it throws stops the
  // generation and is rethrown here.
  Result generate(const std::vector<int64_t> &prompt, const Params &p = {},
                  std::function<bool(int64_t)> on_token = nullptr) {
    specrt_generate_params c;
    specrt_generate_params_init(&c);
    c.method = p.method.empty() ? nullptr : p.method.c_str();
    c.gamma = p.gamma;
    c.temperature = p.temperature;
    c.top_k = p.top_k;
    c.top_p = p.top_p;
    c.min_p = p.min_p;
    c.seed = p.seed;
    c.max_new_tokens = p.max_new_tokens;
    c.stop_token_ids = p.stop_token_ids.data();
    c.num_stop_token_ids = p.stop_token_ids.size();
    Result r;
    r.token_ids.resize(p.max_new_tokens > 0 ? p.max_new_tokens : 0);
    specrt_result out;
    struct Call {  // the callback and what it threw: no exception may cross the C ABI
      std::function<bool(int64_t)> &fn;
      std::exception_ptr error;
    } call{on_token, nullptr};
    auto trampoline = [](int64_t id, void *user) {
      auto *c = static_cast<Call *>(user);
      try {
        return c->fn(id) ? 0 : 1;
      } catch (...) {
        c->error = std::current_exception();
        return 1;  // stop; rethrown below
      }
    };
    specrt_status status = specrt_generate(handle_, prompt.data(), prompt.size(), &c, on_token ? +trampoline : nullptr,
                                           &call, r.token_ids.data(), r.token_ids.size(), &out);
    if (call.error) std::rethrow_exception(call.error);
    check(status);
    r.token_ids.resize(out.num_tokens);
    r.finish_reason = specrt_finish_reason_name(out.finish_reason);
    r.stats = out.stats;
    return r;
  }

 private:
  static void check(specrt_status s) {
    if (s != SPECRT_OK) throw Error(s, specrt_last_error());
  }
  specrt_engine *handle_ = nullptr;
};

}  // namespace specrt
