// The two kinds of failure inside libspecrt; the C ABI turns each into its status code.
#pragma once
#include <stdexcept>
#include <string>

namespace specrt::impl {

// The engine dir is missing, malformed or inconsistent: the Python loader's EngineError, same message.
struct EngineError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A caller's argument is invalid (the Python runtime's SamplingError / ValueError).
struct ArgumentError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ONNX Runtime cannot be loaded or a run failed.
struct RuntimeFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace specrt::impl
