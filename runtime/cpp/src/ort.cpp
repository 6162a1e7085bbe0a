#include "ort.h"

#include <dlfcn.h>

#include <cstdlib>
#include <memory>
#include <mutex>

#include "error.h"

namespace specrt::impl {
namespace {

std::mutex load_mutex;
std::unique_ptr<Ort::Env> env;  // created once, after the API is initialised; lives for the process
std::string version;
const OrtApiBase *api_base = nullptr;

}  // namespace

std::string ort_library_path(const std::string &requested) {
  if (!requested.empty()) return requested;
  if (const char *p = std::getenv("SPECRT_ORT_LIBRARY"); p && *p) return p;
#ifdef SPECRT_DEFAULT_ORT_LIBRARY
  return SPECRT_DEFAULT_ORT_LIBRARY;
#else
  return "libonnxruntime.so.1";
#endif
}

Ort::Env &ort_env(const std::string &library) {
  std::lock_guard<std::mutex> lock(load_mutex);
  if (env) return *env;
  void *handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) throw RuntimeFailure("cannot load ONNX Runtime from " + library + ": " + dlerror() +
                                    " (set SPECRT_ORT_LIBRARY or specrt_open_options.ort_library)");
  using GetApiBase = const OrtApiBase *(*)();
  auto get_base = reinterpret_cast<GetApiBase>(dlsym(handle, "OrtGetApiBase"));
  if (!get_base) throw RuntimeFailure(library + " is not ONNX Runtime (no OrtGetApiBase)");
  const OrtApiBase *base = get_base();
  const OrtApi *api = base->GetApi(ORT_API_VERSION);
  if (!api)
    throw RuntimeFailure("ONNX Runtime " + std::string(base->GetVersionString()) + " at " + library +
                         " is older than API version " + std::to_string(ORT_API_VERSION) + " that libspecrt needs");
  Ort::InitApi(api);
  api_base = base;
  version = base->GetVersionString();
  env = std::make_unique<Ort::Env>(ORT_LOGGING_LEVEL_ERROR, "specrt");
  return *env;
}

const std::string &ort_version() { return version; }

const OrtApiBase *ort_api_base() { return api_base; }

}  // namespace specrt::impl
