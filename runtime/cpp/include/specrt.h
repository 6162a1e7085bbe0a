/* libspecrt: exact speculative decoding of a specrt engine dir, from C or any language with a C FFI.
 *
 * The stable C ABI: opaque handles, plain structs, status codes plus a message getter; nothing of
 * C++ crosses it. One engine handle serves one caller at a time (it owns the KV caches); open
 * several handles for concurrent generations. ONNX Runtime is loaded at run time (dlopen) from
 * specrt_open_options.ort_library, else $SPECRT_ORT_LIBRARY, else the library found at build time,
 * else "libonnxruntime.so.1" on the loader's path; any release at or above API version 21 works.
 *
 *   specrt_engine *e;
 *   if (specrt_engine_open("engine_dir", NULL, &e) != SPECRT_OK) { puts(specrt_last_error()); ... }
 *   specrt_generate_params p; specrt_generate_params_init(&p); p.method = "ngram"; p.max_new_tokens = 64;
 *   int64_t prompt[] = {1, 5, 9}, out[64]; specrt_result r;
 *   specrt_generate(e, prompt, 3, &p, NULL, NULL, out, 64, &r);   // r.num_tokens ids in out
 *   specrt_engine_close(e);
 */
#ifndef SPECRT_H
#define SPECRT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a struct below or a function's signature changes; compare with specrt_abi_version(). */
#define SPECRT_ABI_VERSION 2

#if defined(SPECRT_BUILDING) && defined(__GNUC__)
#define SPECRT_API __attribute__((visibility("default")))
#else
#define SPECRT_API
#endif

typedef enum specrt_status {
  SPECRT_OK = 0,
  SPECRT_ERROR_ENGINE = 1,    /* the engine dir is missing, malformed or inconsistent (the Python loader's EngineError) */
  SPECRT_ERROR_ARGUMENT = 2,  /* a bad argument: sampling parameters, method, prompt length, buffer size */
  SPECRT_ERROR_RUNTIME = 3,   /* ONNX Runtime failed (cannot be loaded, or a run failed) */
} specrt_status;

typedef enum specrt_finish_reason {
  SPECRT_FINISH_STOP = 0,      /* an EOS or stop token (included in the output) */
  SPECRT_FINISH_LENGTH = 1,    /* max_new_tokens, or the KV cache is full */
  SPECRT_FINISH_CANCELLED = 2, /* the token callback returned non-zero */
} specrt_finish_reason;

typedef struct specrt_engine specrt_engine;

typedef struct specrt_open_options {
  const char *ort_library;  /* path of libonnxruntime.so (NULL: see the header comment) */
  int intra_op_threads;     /* target graph's ONNX Runtime intra-op threads (0: ORT's default); the draft uses 1 */
  int spin_duration_us;     /* how long idle pool threads spin (µs) before sleeping; -1: ORT's default */
  const char *attention;    /* who computes the graphs' attention: "specrt" (specrt's CPU kernel, compiled in), "ort"
                               (ONNX Runtime's) or "auto" (the kernel where this build has its AVX-512 or AVX2 code);
                               NULL: $SPECRT_ATTENTION, else "auto" (docs/cpp.md) */
} specrt_open_options;

typedef struct specrt_generate_params {
  const char *method;         /* "none" | "draft" | "ngram" | "suffix"; NULL: the engine dir's default (defaults.method) */
  int gamma;                  /* proposal length per round, 0..manifest gamma; -1: defaults.gamma, else adaptive (per round,
                                 the gamma with the highest predicted speed from measured pass times and acceptance) */
  double temperature;         /* 0 = greedy (argmax, lowest id on ties) */
  int top_k;                  /* 0 = off */
  double top_p;               /* in (0, 1]; 1 = off */
  double min_p;               /* in [0, 1); 0 = off */
  uint64_t seed;              /* the request's random stream */
  int max_new_tokens;         /* >= 1 */
  const int64_t *stop_token_ids; /* extra ids that end generation (besides the engine's EOS ids) */
  size_t num_stop_token_ids;
} specrt_generate_params;

typedef struct specrt_stats {
  int64_t new_tokens;       /* tokens generated */
  int64_t target_passes;    /* target graph calls (prefill chunks included) */
  int64_t draft_passes;     /* draft graph calls (method draft; prefill chunks excluded) */
  int64_t rounds;           /* verify passes after the first token */
  int64_t proposed;         /* tokens proposed */
  int64_t accepted;         /* proposed tokens the target kept */
  int64_t rejections;       /* rounds that ended in a rejection */
  double acceptance_rate;   /* accepted / proposed */
  double alpha;             /* accepted / (accepted + rejections): per-token acceptance */
  double tokens_per_pass;   /* (accepted + rounds) / rounds */
  double wall_seconds;      /* the whole call */
  double engine_seconds;    /* inside ONNX Runtime's Run (target and draft) */
} specrt_stats;

typedef struct specrt_result {
  size_t num_tokens;        /* generated ids written to the output buffer (prompt excluded) */
  int finish_reason;        /* a specrt_finish_reason */
  specrt_stats stats;
} specrt_result;

/* Called once per generated token, in order; return non-zero to stop (finish reason CANCELLED). */
typedef int (*specrt_token_callback)(int64_t token_id, void *user_data);

/* The message of the last failed call on this thread ("" if none). Valid until the next call. */
SPECRT_API const char *specrt_last_error(void);
SPECRT_API const char *specrt_version(void);
SPECRT_API int specrt_abi_version(void); /* the SPECRT_ABI_VERSION the library was built with */
SPECRT_API const char *specrt_finish_reason_name(int finish_reason); /* "stop" | "length" | "cancelled" */

SPECRT_API void specrt_open_options_init(specrt_open_options *options);
SPECRT_API void specrt_generate_params_init(specrt_generate_params *params);

/* Validate ENGINE_DIR's manifest (the Python loader's checks and messages) and open its graphs.
 * options may be NULL. On failure *engine is NULL. */
SPECRT_API specrt_status specrt_engine_open(const char *engine_dir, const specrt_open_options *options, specrt_engine **engine);
SPECRT_API void specrt_engine_close(specrt_engine *engine);

/* Engine facts: the KV-cache capacity in tokens, the vocabulary size, the exported gamma, the
 * default method ("none"/"draft"/"ngram"/... as the manifest says), the ONNX Runtime version and who
 * computes the target graph's attention ("specrt" or "ort"). */
SPECRT_API int specrt_engine_max_len(const specrt_engine *engine);
SPECRT_API int specrt_engine_vocab_size(const specrt_engine *engine);
SPECRT_API int specrt_engine_gamma(const specrt_engine *engine);
SPECRT_API const char *specrt_engine_default_method(const specrt_engine *engine);
SPECRT_API const char *specrt_engine_ort_version(const specrt_engine *engine);
SPECRT_API const char *specrt_engine_attention(const specrt_engine *engine);

/* Generate after prompt (1..max_len-1 ids). Writes at most out_capacity ids to out (out_capacity must
 * be >= params->max_new_tokens); callback may be NULL. result receives count, finish reason, stats. */
SPECRT_API specrt_status specrt_generate(specrt_engine *engine, const int64_t *prompt, size_t prompt_len,
                              const specrt_generate_params *params, specrt_token_callback callback,
                              void *user_data, int64_t *out, size_t out_capacity, specrt_result *result);

#ifdef __cplusplus
}
#endif
#endif /* SPECRT_H */
