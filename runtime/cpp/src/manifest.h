// manifest.json, the engine dir's contract (docs/engine-format.md), validated as strictly as the
// Python loader (engines/manifest.py) does, with the same messages.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace specrt::impl {

struct TensorSpec {
  std::string name;
  std::string dtype;               // "int64" | "int32" | "float32" | "float16"
  std::vector<std::string> shape;  // each dim as Python's repr prints it: "4" or "'past'"
};

struct GraphSpec {
  std::string role;           // "target" | "draft"
  std::string file;           // ONNX file, relative to the engine dir
  std::string decode_file;    // in_place target: the padded graph (export/decode_pad.py), "" = none; this batch-1
                              // runtime runs every call through it (a decode step = the verify pass's row)
  std::string prefill_file;   // in_place target with MatMulNBits: the padded graph on the integer kernel that
                              // prompts run through (export/prefill_graph.py; logits of the last position only)
  std::string architecture;   // HF class name
  int num_layers = 0;         // one past_key.i / past_value.i pair per layer
  int num_kv_heads = 0;
  int head_dim = 0;
  int hidden_size = 0;
  int vocab_size = 0;         // logits width
  std::string dtype;          // "fp32" | "fp16": mask and K/V (logits are float32)
  bool has_hidden = false;    // the graph also outputs `hidden`
  std::string kv_layout;      // "time_major" | "in_place"
  std::optional<int> sliding_window;  // keys this many positions before a query are masked
  std::optional<std::vector<int>> aux_hidden_layers;  // the graph also outputs `aux_hidden` (EAGLE-3's features)
  int prefill_chunk = 128;    // shapes.prefill
  std::vector<TensorSpec> inputs, outputs;  // in graph order
  std::string vocab_sha256;
};

struct Manifest {
  std::string root;                       // the engine dir
  std::map<std::string, GraphSpec> graphs;  // "target" and optionally "draft"
  std::vector<int64_t> eos_token_ids;
  int max_len = 0;                        // KV cache capacity in tokens
  int gamma = 0;                          // exported chain length
  std::string default_method;             // defaults.method, "" if absent
  std::optional<int> default_gamma;       // defaults.gamma (null: none)
  bool has_medusa = false, has_eagle = false;

  const GraphSpec &target() const { return graphs.at("target"); }
  const GraphSpec *draft() const {
    auto it = graphs.find("draft");
    return it == graphs.end() ? nullptr : &it->second;
  }
};

// Read and validate ENGINE_DIR/manifest.json; throws EngineError.
Manifest load_manifest(const std::string &engine_dir);

// The graph contract's input and output names (contract.py io_names).
std::vector<std::string> contract_inputs(int num_layers, const std::string &kv_layout);
std::vector<std::string> contract_outputs(int num_layers, bool has_hidden, const std::string &kv_layout,
                                          bool has_aux = false);

// Python's repr of a list of strings: ['a', 'b'].
std::string py_list(const std::vector<std::string> &items, bool quote = true);

}  // namespace specrt::impl
