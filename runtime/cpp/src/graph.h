// One target or draft graph of an engine dir and its batch-1 KV cache (docs/engine-format.md).
//
// The cache holds `length()` valid entries; a call runs Q new tokens after them at positions
// length()..length()+Q-1 and the graph writes their K/V straight into the cache, past the valid
// entries (time_major: the new_* outputs are bound to cache[L:L+Q]; in_place: past_* and present_*
// are the same buffer), so no step copies the past. `commit(n)` makes the first n of them valid;
// a chain's rollback is that and nothing else.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "manifest.h"
#include "ort.h"

namespace specrt::impl {

class Graph {
 public:
  // threads: intra-op threads (0: ORT's default); spin_us: pool spin duration (-1: ORT's default); attention:
  // "auto" | "ort" | "specrt" ("": $SPECRT_ATTENTION, else auto), src/kernel_attention.h.
  Graph(Ort::Env &env, const std::string &root, const GraphSpec &spec, int max_len, int threads, int spin_us,
        const std::string &attention = "");

  // Run `ids` [q] after the valid entries; returns logits [q, vocab] (valid until the next call).
  // Changes no length: commit what to keep.
  const float *forward(const int64_t *ids, int q);
  void commit(int n);             // keep the first n positions of the last forward
  void rollback(int length);      // keep only the first `length` entries
  const float *prefill(const std::vector<int64_t> &ids);  // in chunks of shapes.prefill (through spec.prefill_file
                                                          // where there is one); logits [vocab] of the last

  int length() const { return length_; }
  int room() const { return max_len_ - length_; }
  int vocab() const { return spec_.vocab_size; }
  bool on_kernel() const { return on_kernel_; }  // its attention runs on specrt's kernel (else ONNX Runtime's)
  int decode_rows() const { return decode_rows_; }  // 2: a one-token call runs as two rows (one_row_differs)

  double engine_seconds = 0;  // time inside Session::Run
  int64_t calls = 0;          // Session::Run calls

 private:
  // One call of `session` (the decode graph's or the prefill graph's), whose logits hold `logit_rows` positions.
  const float *run(const int64_t *ids, int q, Ort::Session &session, int logit_rows);
  void check_inputs() const;  // the graph's inputs must be the manifest's (runtime.py check_graph)
  bool one_row_differs();     // whether a one-row call's row has other bits than in a call of two (at load)
  void build_mask(int q);     // additive mask [1, 1, q, L + q]: causal, sliding window

  GraphSpec spec_;
  int max_len_, length_ = 0, last_q_ = 0;
  size_t elem_;                       // bytes per K/V element (4 fp32, 2 fp16)
  ONNXTensorElementDataType kv_type_;  // the mask's and K/V's element type (the model dtype)
  size_t entry_bytes_;                // one time step of one plane: Hkv * D * elem
  bool in_place_;
  bool on_kernel_ = false;
  int decode_rows_ = 1;  // runtime/in_place.py "Decode rows": 2 where one_row_differs (ONNX Runtime's AVX2 / ARM matmul)
  Ort::Session session_{nullptr};
  Ort::Session prefill_session_{nullptr};  // spec.prefill_file's: prompt chunks (none: session_)
  Ort::MemoryInfo memory_{nullptr};
  std::vector<std::vector<uint8_t>> planes_;  // per layer K, V: time_major [max_len, 1, Hkv, D]; in_place [1, Hkv, max_len, D]
                                              // (max_len + 1 with spec.decode_file)
  std::vector<float> logits_;                 // [q, vocab]
  std::vector<uint8_t> mask_;                 // [q, L + q] in the model dtype
  std::vector<int64_t> positions_;
  int32_t seqlens_k_ = 0, total_ = 0;  // in_place inputs: L + q - 1 and L + q
  std::vector<std::string> input_names_, output_names_;  // the contract's, in graph order
  std::vector<const char *> input_ptrs_, output_ptrs_;   // their c_str()s, for Session::Run
  std::vector<Ort::Value> inputs_, outputs_;  // per call: the small inputs and logits; in_place: the planes, made once
};

}  // namespace specrt::impl
