#include "graph.h"

#include <cstring>

#include <chrono>
#include <fstream>
#include <sstream>

#include "error.h"
#include "kernel_attention.h"

namespace specrt::impl {
namespace {

constexpr float MASK_MIN = -65504.0f;      // contract.py MASK_MIN: float16's most negative finite value
constexpr uint16_t MASK_MIN_FP16 = 0xFBFF;  // the same value's float16 bits

std::string type_name(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return "int64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return "int32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
    default: return "tensor(type " + std::to_string(static_cast<int>(t)) + ")";
  }
}

bool is_int(const std::string &dim) { return !dim.empty() && dim.find_first_not_of("-0123456789") == std::string::npos; }

Ort::Session open_session(Ort::Env &env, const std::string &root, const std::string &file, const Ort::SessionOptions &options) {
  const std::string path = root + "/" + file;
  try {
    return Ort::Session(env, path.c_str(), options);
  } catch (const Ort::Exception &e) {
    std::string what = e.what();
    throw EngineError("ONNX Runtime cannot load " + file.substr(file.find_last_of('/') + 1) + ": " +
                      what.substr(0, what.find('\n')));
  }
}

// `file`'s session with its attention nodes on specrt's kernel (src/kernel_attention.h), or a null session where
// the kernel does not compute them; `kernel_options` hold the kernel and name `root` for the external weights.
Ort::Session open_on_kernel(Ort::Env &env, const std::string &root, const std::string &file,
                            const Ort::SessionOptions &kernel_options) {
  std::ifstream in(root + "/" + file, std::ios::binary);
  if (!in) throw EngineError("graph file missing: " + root + "/" + file);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  int nodes = 0, matmuls = 0;
  std::string model;
  try {
    model = kernel_attention_model(bytes.str(), resolve_matmul(), nodes, matmuls);
  } catch (const EngineError &e) {
    throw EngineError("ONNX Runtime cannot load " + file + ": " + e.what());
  }
  if (!nodes) return Ort::Session{nullptr};
  try {
    return Ort::Session(env, model.data(), model.size(), kernel_options);
  } catch (const Ort::Exception &e) {
    std::string what = e.what();
    throw EngineError("ONNX Runtime cannot load " + file + ": " + what.substr(0, what.find('\n')));
  }
}

}  // namespace

Graph::Graph(Ort::Env &env, const std::string &root, const GraphSpec &spec, int max_len, int threads, int spin_us,
             const std::string &attention)
    : spec_(spec), max_len_(max_len), elem_(spec.dtype == "fp16" ? 2 : 4),
      kv_type_(elem_ == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT),
      in_place_(spec.kv_layout == "in_place") {
  Ort::SessionOptions options;
  options.SetGraphOptimizationLevel(GraphOptimizationLevel::ORT_ENABLE_ALL);
  if (threads > 0) options.SetIntraOpNumThreads(threads);
  if (spin_us >= 0) options.AddConfigEntry("session.intra_op.spin_duration_us", std::to_string(spin_us).c_str());
  if (resolve_attention(attention) == "specrt") {
    Ort::SessionOptions kernel_options = options.Clone();  // graphs load from bytes: their weights are in root
    kernel_options.AddConfigEntry("session.model_external_initializers_file_folder_path", root.c_str());
    register_kernel(kernel_options);
    // the kernel computes each row the same whatever the call: decode steps need no padded graph (custom_ops/)
    session_ = open_on_kernel(env, root, spec.file, kernel_options);
    if (session_ && !spec.prefill_file.empty()) prefill_session_ = open_on_kernel(env, root, spec.prefill_file, kernel_options);
  }
  on_kernel_ = static_cast<bool>(session_);
  // batch 1: every call is one row, so the padded graph (decode_file) replaces the fused one where there is one
  if (!session_) session_ = open_session(env, root, spec.decode_file.empty() ? spec.file : spec.decode_file, options);
  if (!prefill_session_ && !spec.prefill_file.empty()) prefill_session_ = open_session(env, root, spec.prefill_file, options);
  input_names_ = contract_inputs(spec.num_layers, spec.kv_layout);
  output_names_ = contract_outputs(spec.num_layers, false, spec.kv_layout);  // `hidden` is not fetched
  for (const auto &n : input_names_) input_ptrs_.push_back(n.c_str());
  for (const auto &n : output_names_) output_ptrs_.push_back(n.c_str());
  check_inputs();
  memory_ = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
  entry_bytes_ = static_cast<size_t>(spec.num_kv_heads) * spec.head_dim * elem_;
  // + 1 with the padded graph: its padding row writes one entry past a call's new ones (never valid, never read)
  const int64_t entries = max_len + (spec.decode_file.empty() ? 0 : 1);
  planes_.assign(2 * spec.num_layers, std::vector<uint8_t>(entry_bytes_ * entries));
  const size_t small = in_place_ ? 5 : 3;  // ids, positions, mask (+ seqlens_k, total_sequence_length)
  inputs_.resize(small);
  outputs_.resize(1);  // logits
  if (in_place_) {  // the whole buffer, bound as past and as present once: the graph writes its new entries in place
    const int64_t shape[] = {1, spec.num_kv_heads, entries, spec.head_dim};
    for (auto &plane : planes_) {
      inputs_.push_back(Ort::Value::CreateTensor(memory_, plane.data(), plane.size(), shape, 4, kv_type_));
      outputs_.push_back(Ort::Value::CreateTensor(memory_, plane.data(), plane.size(), shape, 4, kv_type_));
    }
  } else {
    inputs_.resize(small + planes_.size());
    outputs_.resize(1 + planes_.size());
  }
  // The target's decode steps must give the verify pass's bits (runtime/in_place.py, "Decode rows"): where a one-row
  // call computes its row apart (ONNX Runtime's MatMulNBits on AVX2 and ARM), one token runs as two rows through the
  // fused graph (a padded graph's padding row would have no entry left at the end of the cache)
  if (in_place_ && spec.role == "target" && one_row_differs()) {
    decode_rows_ = 2;
    if (!on_kernel_ && !spec.decode_file.empty()) session_ = open_session(env, root, spec.file, options);
  }
}

bool Graph::one_row_differs() {
  if (max_len_ < 4 || spec_.vocab_size < 4) return false;
  const int64_t prompt[] = {1, 2}, pair[] = {3, 3};  // a 2-token prompt, then token 3 alone and with a copy after it
  const size_t v = static_cast<size_t>(spec_.vocab_size);
  run(prompt, 2, session_, 2);
  commit(2);
  const float *alone = run(pair, 1, session_, 1);
  std::vector<float> one(alone, alone + v);
  const float *two = run(pair, 2, session_, 2);
  const bool differs = std::memcmp(one.data(), two, v * sizeof(float)) != 0;
  rollback(0);
  engine_seconds = 0;
  calls = 0;
  return differs;
}

void Graph::check_inputs() const {
  std::vector<std::string> names;
  for (size_t i = 0; i < session_.GetInputCount(); ++i)
    names.push_back(session_.GetInputNameAllocated(i, Ort::AllocatorWithDefaultOptions()).get());
  std::vector<std::string> expected;
  for (const auto &t : spec_.inputs) expected.push_back(t.name);
  auto head = [](const std::vector<std::string> &v) { return std::vector<std::string>(v.begin(), v.begin() + std::min<size_t>(4, v.size())); };
  if (names != expected)
    throw EngineError(spec_.file + ": graph inputs " + py_list(head(names)) + "... do not match the manifest (" +
                      py_list(head(expected)) + "...): the engine dir is inconsistent");
  for (size_t i = 0; i < names.size(); ++i) {
    Ort::TypeInfo info = session_.GetInputTypeInfo(i);  // kept alive while its tensor info is read
    auto tensor = info.GetTensorTypeAndShapeInfo();
    std::vector<int64_t> dims = tensor.GetShape();
    std::vector<const char *> symbols(dims.size(), nullptr);
    tensor.GetSymbolicDimensions(symbols.data(), symbols.size());
    std::vector<std::string> shown;
    bool same = dims.size() == spec_.inputs[i].shape.size();
    for (size_t d = 0; d < dims.size(); ++d) {
      shown.push_back(dims[d] >= 0 ? std::to_string(dims[d]) : (symbols[d] && *symbols[d] ? "'" + std::string(symbols[d]) + "'" : "None"));
      if (same && dims[d] >= 0 && is_int(spec_.inputs[i].shape[d]) && std::to_string(dims[d]) != spec_.inputs[i].shape[d]) same = false;
    }
    std::string dtype = type_name(tensor.GetElementType());
    if (dtype != spec_.inputs[i].dtype || !same)
      throw EngineError(spec_.file + ": input '" + names[i] + "' is " + dtype + " " + py_list(shown, false) +
                        " in the graph but " + spec_.inputs[i].dtype + " " + py_list(spec_.inputs[i].shape, false) +
                        " in the manifest: the engine dir is inconsistent");
  }
}

void Graph::build_mask(int q) {
  const int total = length_ + q;
  mask_.assign(static_cast<size_t>(q) * total * elem_, 0);  // 0 = attend (0.0 in fp32 and fp16)
  auto masked = [&](int i, int t) {
    const int pos_q = length_ + i;  // entry t holds position t: the cache is a row's positions in order
    return t > pos_q || (spec_.sliding_window && t <= pos_q - *spec_.sliding_window);
  };
  for (int i = 0; i < q; ++i)
    for (int t = 0; t < total; ++t)
      if (masked(i, t)) {
        size_t at = static_cast<size_t>(i) * total + t;
        if (elem_ == 2) reinterpret_cast<uint16_t *>(mask_.data())[at] = MASK_MIN_FP16;
        else reinterpret_cast<float *>(mask_.data())[at] = MASK_MIN;
      }
}

const float *Graph::forward(const int64_t *ids, int q) {
  if (q == 1 && decode_rows_ == 2 && length_ + 2 <= max_len_) {  // the token, then a dummy copy no row attends to
    const int64_t pair[] = {ids[0], ids[0]};
    const float *logits = run(pair, 2, session_, 2);  // row 0's logits first
    last_q_ = 1;
    return logits;
  }
  return run(ids, q, session_, q);
}

const float *Graph::run(const int64_t *ids, int q, Ort::Session &session, int logit_rows) {
  if (q < 1 || length_ + q > max_len_)
    throw RuntimeFailure("KV cache full: " + std::to_string(length_) + " + " + std::to_string(q) + " tokens > max_len " +
                         std::to_string(max_len_));
  const int L = length_, V = spec_.vocab_size;
  positions_.resize(q);
  for (int i = 0; i < q; ++i) positions_[i] = L + i;
  build_mask(q);
  logits_.resize(static_cast<size_t>(logit_rows) * V);
  const int64_t ids_shape[] = {1, q}, mask_shape[] = {1, 1, q, L + q}, logits_shape[] = {1, logit_rows, V}, one[] = {1};
  seqlens_k_ = L + q - 1;
  total_ = L + q;
  inputs_[0] = Ort::Value::CreateTensor<int64_t>(memory_, const_cast<int64_t *>(ids), q, ids_shape, 2);
  inputs_[1] = Ort::Value::CreateTensor<int64_t>(memory_, positions_.data(), q, ids_shape, 2);
  inputs_[2] = Ort::Value::CreateTensor(memory_, mask_.data(), mask_.size(), mask_shape, 4, kv_type_);
  outputs_[0] = Ort::Value::CreateTensor<float>(memory_, logits_.data(), logits_.size(), logits_shape, 3);
  if (in_place_) {
    inputs_[3] = Ort::Value::CreateTensor<int32_t>(memory_, &seqlens_k_, 1, one, 1);
    inputs_[4] = Ort::Value::CreateTensor<int32_t>(memory_, &total_, 1, one, 0);
  } else {
    const int64_t hkv = spec_.num_kv_heads, d = spec_.head_dim;
    const int64_t past_shape[] = {L, 1, hkv, d}, new_shape[] = {q, 1, hkv, d};
    for (size_t j = 0; j < planes_.size(); ++j) {  // past = cache[:L]; the new K/V land in cache[L:L+q]
      uint8_t *plane = planes_[j].data();
      inputs_[3 + j] = Ort::Value::CreateTensor(memory_, plane, entry_bytes_ * L, past_shape, 4, kv_type_);
      outputs_[1 + j] = Ort::Value::CreateTensor(memory_, plane + entry_bytes_ * L, entry_bytes_ * q, new_shape, 4, kv_type_);
    }
  }
  auto t0 = std::chrono::steady_clock::now();
  try {
    session.Run(Ort::RunOptions{nullptr}, input_ptrs_.data(), inputs_.data(), inputs_.size(), output_ptrs_.data(),
                 outputs_.data(), outputs_.size());
  } catch (const Ort::Exception &e) {
    throw RuntimeFailure(spec_.role + " graph: ONNX Runtime run failed: " + e.what());
  }
  engine_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ++calls;
  last_q_ = q;
  return logits_.data();
}

void Graph::commit(int n) {
  if (n < 0 || n > last_q_) throw RuntimeFailure("commit of " + std::to_string(n) + " positions after a call of " + std::to_string(last_q_));
  length_ += n;
  last_q_ = 0;
}

void Graph::rollback(int length) {
  if (length < 0 || length > length_)
    throw RuntimeFailure("cannot roll back to " + std::to_string(length) + ": the cache holds " + std::to_string(length_));
  length_ = length;
}

const float *Graph::prefill(const std::vector<int64_t> &ids) {
  const float *logits = nullptr;
  const int chunk = spec_.prefill_chunk;
  int last = 0;
  for (size_t i = 0; i < ids.size(); i += chunk) {
    last = static_cast<int>(std::min(ids.size() - i, static_cast<size_t>(chunk)));
    // the prefill graph (export/prefill_graph.py) computes the last position's logits only
    logits = prefill_session_ ? run(ids.data() + i, last, prefill_session_, 1) : forward(ids.data() + i, last);
    commit(last);
  }
  return prefill_session_ ? logits : logits + static_cast<size_t>(last - 1) * spec_.vocab_size;
}

}  // namespace specrt::impl
