// ONNX Runtime, loaded at run time: dlopen the library and take its API at the headers' version
// (ORT_API_MANUAL_INIT), so one build runs with any onnxruntime release at or above it.
#pragma once
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>

#include <string>

namespace specrt::impl {

// The library to load: `requested` if non-empty, else $SPECRT_ORT_LIBRARY, else the one found at
// build time, else "libonnxruntime.so.1" on the loader's path.
std::string ort_library_path(const std::string &requested);

// Load ONNX Runtime once per process (later calls reuse the first library) and return the
// process's environment; throws RuntimeFailure naming the library and the reason.
Ort::Env &ort_env(const std::string &library);

// The loaded library's version string ("1.32.0").
const std::string &ort_version();

// The loaded library's API base (custom op libraries register through it); null before ort_env.
const OrtApiBase *ort_api_base();

}  // namespace specrt::impl
