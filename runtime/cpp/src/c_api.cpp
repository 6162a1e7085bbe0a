// The C ABI (include/specrt.h) over the engine: every C++ exception becomes a status code and a
// thread-local message; nothing C++ crosses the boundary.
#include <cstring>
#include <string>

#include "decoder.h"
#include "error.h"
#include "specrt.h"

using namespace specrt::impl;

struct specrt_engine {
  Engine engine;
  std::string default_method;
};

namespace {

thread_local std::string last_error;

template <class F>
specrt_status guarded(F &&body) {
  try {
    last_error.clear();
    body();
    return SPECRT_OK;
  } catch (const EngineError &e) {
    last_error = e.what();
    return SPECRT_ERROR_ENGINE;
  } catch (const ArgumentError &e) {
    last_error = e.what();
    return SPECRT_ERROR_ARGUMENT;
  } catch (const std::exception &e) {
    last_error = e.what();
    return SPECRT_ERROR_RUNTIME;
  } catch (...) {
    last_error = "unknown error";
    return SPECRT_ERROR_RUNTIME;
  }
}

[[noreturn]] void argument(const std::string &msg) { throw ArgumentError(msg); }

}  // namespace

extern "C" {

const char *specrt_last_error(void) { return last_error.c_str(); }
const char *specrt_version(void) { return SPECRT_VERSION; }
int specrt_abi_version(void) { return SPECRT_ABI_VERSION; }

const char *specrt_finish_reason_name(int reason) {
  switch (reason) {
    case SPECRT_FINISH_STOP: return "stop";
    case SPECRT_FINISH_LENGTH: return "length";
    case SPECRT_FINISH_CANCELLED: return "cancelled";
    default: return "unknown";
  }
}

void specrt_open_options_init(specrt_open_options *o) {
  if (o) *o = specrt_open_options{nullptr, 0, Engine::Options{}.spin_duration_us, nullptr};
}

void specrt_generate_params_init(specrt_generate_params *p) {
  if (p) *p = specrt_generate_params{nullptr, -1, 0.0, 0, 1.0, 0.0, 0, 64, nullptr, 0};
}

specrt_status specrt_engine_open(const char *engine_dir, const specrt_open_options *options, specrt_engine **engine) {
  return guarded([&] {
    if (!engine) argument("engine: NULL output pointer");
    *engine = nullptr;
    if (!engine_dir) argument("engine_dir: NULL");
    Engine::Options o;
    if (options) {
      o.ort_library = options->ort_library ? options->ort_library : "";
      o.intra_op_threads = options->intra_op_threads;
      o.spin_duration_us = options->spin_duration_us;
      o.attention = options->attention ? options->attention : "";
    }
    auto *e = new specrt_engine{Engine(engine_dir, o), ""};
    e->default_method = e->engine.default_method();
    *engine = e;
  });
}

void specrt_engine_close(specrt_engine *engine) { delete engine; }

int specrt_engine_max_len(const specrt_engine *e) { return e ? e->engine.manifest().max_len : 0; }
int specrt_engine_vocab_size(const specrt_engine *e) { return e ? e->engine.manifest().target().vocab_size : 0; }
int specrt_engine_gamma(const specrt_engine *e) { return e ? e->engine.manifest().gamma : 0; }
const char *specrt_engine_default_method(const specrt_engine *e) { return e ? e->default_method.c_str() : ""; }
const char *specrt_engine_ort_version(const specrt_engine *) { return ort_version().c_str(); }
const char *specrt_engine_attention(const specrt_engine *e) { return e && e->engine.target_on_kernel() ? "specrt" : "ort"; }

specrt_status specrt_generate(specrt_engine *engine, const int64_t *prompt, size_t prompt_len,
                              const specrt_generate_params *params, specrt_token_callback callback, void *user_data,
                              int64_t *out, size_t out_capacity, specrt_result *result) {
  return guarded([&] {
    if (!engine || !params || !result || (!prompt && prompt_len)) argument("engine, params and result must not be NULL");
    if (!out || static_cast<int64_t>(out_capacity) < params->max_new_tokens)  // (max_new_tokens itself: the engine checks it)
      argument("out_capacity " + std::to_string(out_capacity) + " < max_new_tokens " + std::to_string(params->max_new_tokens));
    GenerateRequest req;
    req.prompt.assign(prompt, prompt + prompt_len);
    req.method = params->method ? params->method : "";
    req.gamma = params->gamma;
    req.sampling = {params->temperature, params->top_k, params->top_p, params->min_p};
    req.seed = params->seed;
    req.max_new_tokens = params->max_new_tokens;
    if (params->stop_token_ids) req.stop_token_ids.assign(params->stop_token_ids, params->stop_token_ids + params->num_stop_token_ids);
    TokenCallback on_token;
    if (callback) on_token = [&](int64_t t) { return callback(t, user_data) == 0; };
    Generation g = engine->engine.generate(req, on_token);
    std::memcpy(out, g.tokens.data(), g.tokens.size() * sizeof(int64_t));
    const Counts &c = g.counts;
    result->num_tokens = g.tokens.size();
    result->finish_reason = g.finish_reason == "stop" ? SPECRT_FINISH_STOP
                            : g.finish_reason == "length" ? SPECRT_FINISH_LENGTH : SPECRT_FINISH_CANCELLED;
    const double rounds = c.rounds ? static_cast<double>(c.rounds) : 1.0, tested = static_cast<double>(c.accepted + c.rejections);
    result->stats = specrt_stats{static_cast<int64_t>(g.tokens.size()), c.target_passes, c.draft_passes, c.rounds,
                                 c.proposed, c.accepted, c.rejections,
                                 c.proposed ? static_cast<double>(c.accepted) / c.proposed : 0.0,
                                 tested ? c.accepted / tested : 0.0, (c.accepted + c.rounds) / rounds,
                                 c.wall_seconds, c.engine_seconds};
  });
}

}  // extern "C"
