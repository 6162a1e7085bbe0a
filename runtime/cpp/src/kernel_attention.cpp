#include "kernel_attention.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <vector>

#include "error.h"

#include "kernels.h"  // custom_ops/: the int4 matmul beside the attention kernel

// custom_ops/attention.cpp, compiled into this library with its export attribute turned off
extern "C" OrtStatus *ORT_API_CALL RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *api_base);

namespace specrt::impl {
namespace {

constexpr char kDomain[] = "ai.specrt";  // the kernel's op domain (custom_ops/attention.cpp, custom_ops DOMAIN)

// One field of a protobuf message in wire format: bytes [begin, end) of the buffer, its value at
// [value, end) (a length-delimited field's payload), `varint` for wire type 0.
struct Field {
  uint32_t number = 0;
  int wire = 0;
  size_t begin = 0, value = 0, end = 0;
  uint64_t varint = 0;
};

[[noreturn]] void malformed(const char *what) {
  throw EngineError(std::string("not an ONNX model (") + what + ")");
}

uint64_t read_varint(const std::string &b, size_t &at, size_t end) {
  uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (at >= end) malformed("a truncated varint");
    const uint8_t c = static_cast<uint8_t>(b[at++]);
    v |= static_cast<uint64_t>(c & 0x7f) << shift;
    if (!(c & 0x80)) return v;
  }
  malformed("a varint of more than 10 bytes");
}

// The fields of the message at bytes [begin, end) of `b`, in order.
std::vector<Field> fields(const std::string &b, size_t begin, size_t end) {
  std::vector<Field> out;
  for (size_t at = begin; at < end;) {
    Field f;
    f.begin = at;
    const uint64_t key = read_varint(b, at, end);
    f.number = static_cast<uint32_t>(key >> 3);
    f.wire = static_cast<int>(key & 7);
    uint64_t size = 0;
    switch (f.wire) {
      case 0: f.value = at; f.varint = read_varint(b, at, end); break;
      case 1: size = 8; break;
      case 2: size = read_varint(b, at, end); break;
      case 5: size = 4; break;
      default: malformed("a group field");  // ONNX's messages have none
    }
    if (f.wire != 0) {
      if (size > end - at) malformed("a field running past its message");
      f.value = at;
      at += size;
    }
    f.end = at;
    out.push_back(f);
  }
  return out;
}

std::string text(const std::string &b, const Field &f) { return b.substr(f.value, f.end - f.value); }

void put_varint(std::string &out, uint64_t v) {
  for (; v >= 0x80; v >>= 7) out.push_back(static_cast<char>((v & 0x7f) | 0x80));
  out.push_back(static_cast<char>(v));
}

void put_bytes(std::string &out, uint32_t number, const std::string &payload) {  // a length-delimited field
  put_varint(out, (static_cast<uint64_t>(number) << 3) | 2);
  put_varint(out, payload.size());
  out += payload;
}

// A NodeProto's inputs (field 1, "" for an absent optional one), outputs (2), op_type (4), domain (7) and
// attributes (5: AttributeProto name 1, f 2, i 3).
struct Node {
  std::vector<std::string> inputs, output_names;
  int outputs = 0;
  std::string op, domain;
  std::map<std::string, std::pair<int64_t, float>> attrs;  // name -> (i, f)
};

Node read_node(const std::string &b, const std::vector<Field> &node) {
  Node n;
  for (const Field &f : node) {
    if (f.number == 1 && f.wire == 2) n.inputs.push_back(text(b, f));
    if (f.number == 2 && f.wire == 2) ++n.outputs, n.output_names.push_back(text(b, f));
    if (f.number == 4 && f.wire == 2) n.op = text(b, f);
    if (f.number == 7 && f.wire == 2) n.domain = text(b, f);
    if (f.number != 5 || f.wire != 2) continue;
    std::string name;
    int64_t i = 0;
    float x = 0.0f;
    for (const Field &a : fields(b, f.value, f.end)) {
      if (a.number == 1 && a.wire == 2) name = text(b, a);
      if (a.number == 2 && a.wire == 5) std::memcpy(&x, b.data() + a.value, 4);
      if (a.number == 3 && a.wire == 0) i = static_cast<int64_t>(a.varint);
    }
    n.attrs[name] = {i, x};
  }
  return n;
}

// Whether the kernel computes a GroupQueryAttention node: custom_ops/__init__.py `supported` (packed QKV, rotary
// inside, 3 outputs, only the attributes and values the kernel implements).
bool supported(const Node &n) {
  for (const auto &[name, value] : n.attrs) {
    const auto [i, x] = value;
    const bool ok = name == "num_heads" || name == "kv_num_heads" || name == "scale" ||
                    (name == "do_rotary" && i == 1) || (name == "rotary_interleaved" && i == 0) ||
                    (name == "local_window_size" && i == -1) || (name == "softcap" && x == 0.0f) ||
                    (name == "smooth_softmax" && i == 0);
    if (!ok) return false;
  }
  if (n.inputs.size() > 11 || n.outputs != 3) return false;
  std::vector<std::string> inputs = n.inputs;
  inputs.resize(11);
  if (!inputs[1].empty() || !inputs[2].empty()) return false;
  for (int k : {0, 3, 4, 5, 6, 7, 8, 9})
    if (inputs[k].empty()) return false;
  return true;
}

// Whether the int4 matmul computes a MatMulNBits node: custom_ops/__init__.py `supported_matmul` (bits 4,
// block_size 32, accuracy_level 4, K % 32 == 0, N % 16 == 0, 3 inputs, the weights and scales initializers).
bool supported_matmul(const Node &n, const std::set<std::string> &initializers) {
  auto attr = [&](const char *name) { return n.attrs.count(name) ? n.attrs.at(name).first : -1; };
  return attr("bits") == 4 && attr("block_size") == 32 && attr("accuracy_level") == 4 && attr("K") > 0 &&
         attr("K") % 32 == 0 && attr("N") > 0 && attr("N") % 16 == 0 && n.inputs.size() == 3 && n.outputs == 1 &&
         initializers.count(n.inputs[1]) && initializers.count(n.inputs[2]);
}

// A node's op_type if its domain is com.microsoft (ONNX Runtime's contrib ops), else "".
std::string contrib_op(const std::string &b, const std::vector<Field> &node) {
  std::string op, domain;
  for (const Field &f : node) {
    if (f.number == 4 && f.wire == 2) op = text(b, f);
    if (f.number == 7 && f.wire == 2) domain = text(b, f);
  }
  return domain == "com.microsoft" ? op : "";
}

// The values of an INT64 TensorProto (data_type 2 == 7; int64_data 7, packed or not, or raw_data 9); empty for
// any other.
std::vector<int64_t> int64_values(const std::string &b, const Field &tensor) {
  std::vector<int64_t> out;
  bool is_int64 = false;
  for (const Field &f : fields(b, tensor.value, tensor.end)) {
    if (f.number == 2 && f.wire == 0) is_int64 = f.varint == 7;
    if (f.number == 7 && f.wire == 0) out.push_back(static_cast<int64_t>(f.varint));
    if (f.number == 7 && f.wire == 2)
      for (size_t at = f.value; at < f.end;) out.push_back(static_cast<int64_t>(read_varint(b, at, f.end)));
    if (f.number == 9 && f.wire == 2)
      for (size_t at = f.value; at + 8 <= f.end; at += 8) {
        int64_t v;
        std::memcpy(&v, b.data() + at, 8);
        out.push_back(v);
      }
  }
  return is_int64 ? out : std::vector<int64_t>{};
}

// The nodes folded into the int4 matmuls (custom_ops/__init__.py fuse_swiglu and fuse_norms, the same rules).
struct Rewrite {  // a matmul's inputs and outputs once folded, the attributes it gains (AttributeProtos), its new op
  std::vector<std::string> inputs, outputs;
  std::string attributes, op;  // op: "" keeps the node's own
};
struct Fusions {
  std::map<size_t, Rewrite> matmuls;  // every renamed matmul (its index in the graph's fields) -> what it becomes
  int int8 = 0;                       // of them, MatMulIntegerToFloat nodes made MatMulInt8
  std::map<size_t, size_t> placed;    // a folded norm -> the matmul written where it stood
  std::set<size_t> dropped;           // the fields removed: folded nodes, split sizes nothing reads, moved matmuls
};

void put_attribute(std::string &node, const std::string &name, int64_t i) {  // AttributeProto: name 1, i 3, type 20 INT
  std::string a;
  put_bytes(a, 1, name);
  put_varint(a, 3u << 3), put_varint(a, static_cast<uint64_t>(i));
  put_varint(a, 20u << 3), put_varint(a, 2);
  put_bytes(node, 5, a);
}

void put_attribute(std::string &node, const std::string &name, float f) {  // name 1, f 2 (fixed32), type 20 FLOAT
  std::string a;
  put_bytes(a, 1, name);
  put_varint(a, (2u << 3) | 5);
  char bits[4];
  std::memcpy(bits, &f, 4);
  a.append(bits, 4);
  put_varint(a, 20u << 3), put_varint(a, 1);
  put_bytes(node, 5, a);
}

// The tensors' readers, the initializers and the graph's outputs: what both rules check.
struct Readers {
  std::map<std::string, std::vector<size_t>> of;  // tensor -> the nodes reading it
  std::map<std::string, size_t> initializers;     // GraphProto initializer 5 (name 8) -> its field
  std::map<std::string, size_t> producer;         // tensor -> the node writing it
  std::set<std::string> outputs;                  // GraphProto output 12 (ValueInfoProto name 1)
};

Readers readers_of(const std::string &b, const std::vector<Field> &items, const std::vector<Node> &nodes) {
  Readers r;
  for (size_t k = 0; k < items.size(); ++k) {
    if (items[k].number == 1 && items[k].wire == 2) {
      for (const std::string &in : nodes[k].inputs) r.of[in].push_back(k);
      for (const std::string &out : nodes[k].output_names)
        if (!out.empty()) r.producer[out] = k;
    }
    if ((items[k].number == 5 || items[k].number == 12) && items[k].wire == 2)
      for (const Field &f : fields(b, items[k].value, items[k].end))
        if (f.number == (items[k].number == 5 ? 8u : 1u) && f.wire == 2)
          items[k].number == 5 ? void(r.initializers[text(b, f)] = k) : void(r.outputs.insert(text(b, f)));
  }
  return r;
}

// SwiGLU: MatMulNBits -> Split in two halves -> Sigmoid(gate) -> Mul(gate, sigmoid) -> Mul(silu, up), nothing else
// reading the tensors between: the matmul takes the last Mul's output and swiglu = 1.
void fold_swiglus(const std::string &b, const std::vector<Field> &items, const std::vector<Node> &nodes, Readers &rd,
                  Fusions &out) {
  auto &readers = rd.of;
  auto &initializers = rd.initializers;
  auto &outputs = rd.outputs;
  auto only = [&](const std::string &tensor, const char *op) -> const Node * {  // its one reader, an `op`
    auto it = readers.find(tensor);
    if (it == readers.end() || it->second.size() != 1 || outputs.count(tensor)) return nullptr;
    const Node &n = nodes[it->second[0]];
    return n.op == op && (n.domain.empty() || n.domain == "ai.onnx") ? &n : nullptr;
  };
  auto index = [&](const Node *n) { return static_cast<size_t>(n - nodes.data()); };
  auto same = [](std::vector<std::string> a, std::vector<std::string> b) {
    std::sort(a.begin(), a.end()), std::sort(b.begin(), b.end());
    return a == b;
  };
  std::map<std::string, size_t> folded_reads;  // split sizes -> the folded splits reading them
  for (auto &[k, rewrite] : out.matmuls) {
    if (nodes[k].output_names.size() != 1) continue;
    const int64_t n = nodes[k].attrs.at("N").first;
    const Node *split = only(nodes[k].output_names[0], "Split");
    if (!split || n % 32 || split->output_names.size() != 2 || split->attrs.count("split") ||
        split->attrs.count("axis") != 1 || split->attrs.at("axis").first != -1)
      continue;
    const bool sized = split->inputs.size() > 1 && !split->inputs[1].empty();
    if (sized) {
      auto sizes = initializers.find(split->inputs[1]);
      if (sizes == initializers.end() || int64_values(b, items[sizes->second]) != std::vector<int64_t>{n / 2, n / 2})
        continue;
    }
    const std::string &gate = split->output_names[0], &up = split->output_names[1];
    const std::vector<size_t> &gate_readers = readers[gate];
    if (gate_readers.size() != 2 || outputs.count(gate)) continue;
    const Node *sigmoid = nullptr, *silu = nullptr;
    for (size_t r : gate_readers) {
      if (!nodes[r].domain.empty() && nodes[r].domain != "ai.onnx") continue;
      if (nodes[r].op == "Sigmoid" && nodes[r].output_names.size() == 1) sigmoid = &nodes[r];
      if (nodes[r].op == "Mul" && nodes[r].output_names.size() == 1) silu = &nodes[r];
    }
    if (!sigmoid || !silu || only(sigmoid->output_names[0], "Mul") != silu ||
        !same(silu->inputs, {gate, sigmoid->output_names[0]}))
      continue;
    const Node *act = only(silu->output_names[0], "Mul");
    if (!act || act->output_names.size() != 1 || only(up, "Mul") != act || !same(act->inputs, {silu->output_names[0], up}))
      continue;
    rewrite.outputs[0] = act->output_names[0];
    put_attribute(rewrite.attributes, "swiglu", int64_t{1});
    out.dropped.insert({index(split), index(sigmoid), index(silu), index(act)});
    if (sized) ++folded_reads[split->inputs[1]];
  }
  for (const auto &[name, count] : folded_reads)  // split sizes only the dropped nodes read (one for every layer's)
    if (readers[name].size() == count) out.dropped.insert(initializers[name]);
}

// RMS norms: SimplifiedLayerNormalization(x, gamma) or SkipSimplifiedLayerNormalization(x, skip, gamma) whose output
// only the matmul reads (an explicit epsilon, the last axis, no beta or bias, no statistics read): the matmul takes
// (x, B, scales, gamma[, skip]), outputs (Y[, x + skip]), norm_epsilon, and stands where the norm stood.
void fold_norms(const std::vector<Node> &nodes, Readers &rd, Fusions &out) {
  for (auto &[k, rewrite] : out.matmuls) {
    auto p = rd.producer.find(nodes[k].inputs[0]);
    if (p == rd.producer.end()) continue;
    const Node &norm = nodes[p->second];
    const bool skip = norm.op == "SkipSimplifiedLayerNormalization" && norm.domain == "com.microsoft";
    if (!skip && !(norm.op == "SimplifiedLayerNormalization" && (norm.domain.empty() || norm.domain == "ai.onnx")))
      continue;
    std::vector<std::string> in = norm.inputs, outs = norm.output_names;
    in.resize(std::max<size_t>(in.size(), 5)), outs.resize(std::max<size_t>(outs.size(), 4));
    bool extra_inputs = false;
    for (size_t i = skip ? 3 : 2; i < 5; ++i) extra_inputs |= !in[i].empty();
    if (!norm.attrs.count("epsilon") || (norm.attrs.count("axis") && norm.attrs.at("axis").first != -1) ||
        extra_inputs || !outs[1].empty() || !outs[2].empty() || rd.outputs.count(outs[0]) || rd.of[outs[0]].size() != 1)
      continue;
    rewrite.inputs = {in[0], nodes[k].inputs[1], nodes[k].inputs[2], in[skip ? 2 : 1]};
    if (skip) rewrite.inputs.push_back(in[1]);
    if (skip && !outs[3].empty()) rewrite.outputs.push_back(outs[3]);
    put_attribute(rewrite.attributes, "norm_epsilon", norm.attrs.at("epsilon").second);
    out.placed[p->second] = k;
    out.dropped.insert(k);
  }
}

// A TensorProto's data_type (field 2) and dims (field 1, packed or not).
struct TensorInfo {
  uint64_t type = 0;
  std::vector<int64_t> dims;
};

TensorInfo tensor_info(const std::string &b, const Field &tensor) {
  TensorInfo t;
  for (const Field &f : fields(b, tensor.value, tensor.end)) {
    if (f.number == 2 && f.wire == 0) t.type = f.varint;
    if (f.number == 1 && f.wire == 0) t.dims.push_back(static_cast<int64_t>(f.varint));
    if (f.number == 1 && f.wire == 2)
      for (size_t at = f.value; at < f.end;) t.dims.push_back(static_cast<int64_t>(read_varint(b, at, f.end)));
  }
  return t;
}

// int8 matmuls (custom_ops/__init__.py fuse_int8_matmuls, the same rule): QuantizeLinear(x, s, z) per row (axis -1,
// block_size K) -> com.microsoft::MatMulIntegerToFloat(q, B, a_scale, b_scale, a_zero_point), B int8 [K, N] with
// N % 16 == 0, b_scale [N], scalar a_scale and uint8 zero point, all initializers -> Mul(y, s), the only reader of y:
// ai.specrt::MatMulInt8(q, B, a_scale, b_scale, a_zero_point, s) writing the Mul's output, where the matmul stood.
void fold_int8(const std::string &b, const std::vector<Field> &items, const std::vector<Node> &nodes, Readers &rd,
               Fusions &out) {
  constexpr uint64_t kFloat = 1, kUint8 = 2, kInt8 = 3;  // TensorProto.DataType
  for (size_t k = 0; k < nodes.size(); ++k) {
    const Node &mm = nodes[k];
    if (mm.op != "MatMulIntegerToFloat" || mm.domain != "com.microsoft" || mm.inputs.size() != 5 ||
        mm.output_names.size() != 1)
      continue;
    std::vector<TensorInfo> init;
    for (size_t i = 1; i < 5; ++i) {
      auto it = rd.initializers.find(mm.inputs[i]);
      if (it == rd.initializers.end()) break;
      init.push_back(tensor_info(b, items[it->second]));
    }
    if (init.size() != 4) continue;
    const TensorInfo &w = init[0], &a_scale = init[1], &b_scale = init[2], &zero = init[3];
    auto scalar = [](const TensorInfo &t) {
      return std::all_of(t.dims.begin(), t.dims.end(), [](int64_t d) { return d == 1; });
    };
    if (w.type != kInt8 || w.dims.size() != 2 || w.dims[1] % 16 || b_scale.type != kFloat ||
        b_scale.dims != std::vector<int64_t>{w.dims[1]} || a_scale.type != kFloat || !scalar(a_scale) ||
        zero.type != kUint8 || !scalar(zero))
      continue;
    auto p = rd.producer.find(mm.inputs[0]);
    if (p == rd.producer.end()) continue;
    const Node &quantize = nodes[p->second];
    auto attr = [&](const char *name, int64_t absent) {
      return quantize.attrs.count(name) ? quantize.attrs.at(name).first : absent;
    };
    if (quantize.op != "QuantizeLinear" || !(quantize.domain.empty() || quantize.domain == "ai.onnx") ||
        quantize.inputs.size() < 2 || attr("axis", 1) != -1 || attr("block_size", 0) != w.dims[0])
      continue;
    const std::string &scale = quantize.inputs[1], &y = mm.output_names[0];
    const std::vector<size_t> &readers = rd.of[y];
    if (readers.size() != 1 || rd.outputs.count(y)) continue;
    const Node &mul = nodes[readers[0]];
    std::vector<std::string> mul_inputs = mul.inputs, want = {y, scale};
    std::sort(mul_inputs.begin(), mul_inputs.end()), std::sort(want.begin(), want.end());
    if (mul.op != "Mul" || !(mul.domain.empty() || mul.domain == "ai.onnx") || mul_inputs != want ||
        mul.output_names.size() != 1)
      continue;
    std::vector<std::string> inputs = mm.inputs;
    inputs.push_back(scale);
    out.matmuls[k] = {inputs, mul.output_names, "", "MatMulInt8"};
    out.dropped.insert(readers[0]);
    ++out.int8;
  }
}

}  // namespace

std::string resolve_attention(const std::string &asked) {
  std::string a = asked;
  if (a.empty()) {
    const char *env = std::getenv("SPECRT_ATTENTION");
    a = env && *env ? env : "auto";
  }
  if (a != "auto" && a != "ort" && a != "specrt")
    throw ArgumentError("attention must be one of auto, ort, specrt, got '" + a + "'");
  if (a == "auto") return kernel_has_vector_code() ? "specrt" : "ort";
  return a;
}

bool resolve_matmul() {
  const char *env = std::getenv("SPECRT_MATMUL");
  const std::string a = env && *env ? env : "auto";
  if (a != "auto" && a != "ort" && a != "specrt")
    throw ArgumentError("SPECRT_MATMUL must be one of auto, ort, specrt, got '" + a + "'");
  if (a == "specrt" && !specrt_matmul_nbits_runs())
    throw ArgumentError("SPECRT_MATMUL=specrt needs a CPU with AVX2 and FMA or AVX-512 VNNI (or SPECRT_ISA=ref)");
  return a != "ort" && specrt_matmul_nbits_runs();
}

bool kernel_has_vector_code() {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return true;
#else
  return false;
#endif
}

std::string kernel_attention_model(const std::string &model, bool matmul, int &nodes, int &matmuls) {
  nodes = 0;
  matmuls = 0;
  const std::vector<Field> top = fields(model, 0, model.size());  // ModelProto: graph 7, opset_import 8
  const Field *graph = nullptr;
  for (const Field &f : top)
    if (f.number == 7 && f.wire == 2) graph = &f;
  if (!graph) malformed("no graph");
  const std::vector<Field> items = fields(model, graph->value, graph->end);  // GraphProto: node 1
  std::set<std::string> initializers;  // GraphProto: initializer 5 (TensorProto: name 8)
  for (const Field &f : items)
    if (f.number == 5 && f.wire == 2)
      for (const Field &t : fields(model, f.value, f.end))
        if (t.number == 8 && t.wire == 2) initializers.insert(text(model, t));
  std::vector<bool> renamed(items.size(), false), renamed_matmul(items.size(), false);
  std::vector<Node> graph_nodes(items.size());  // the nodes' fields read (empty for the graph's other fields)
  for (size_t k = 0; k < items.size(); ++k) {
    if (items[k].number != 1 || items[k].wire != 2) continue;
    const std::vector<Field> node = fields(model, items[k].value, items[k].end);
    graph_nodes[k] = read_node(model, node);
    const std::string op = contrib_op(model, node);
    if (matmul && op == "MatMulNBits" && supported_matmul(graph_nodes[k], initializers)) {
      renamed[k] = renamed_matmul[k] = true;
      ++matmuls;
    }
    if (op != "GroupQueryAttention") continue;
    if (!supported(graph_nodes[k])) return "";  // all or none: every attention row follows one rule
    renamed[k] = true;
    ++nodes;
  }
  if (!nodes) return "";
  Fusions fused;
  for (size_t k = 0; k < items.size(); ++k)
    if (renamed_matmul[k]) fused.matmuls[k] = {graph_nodes[k].inputs, graph_nodes[k].output_names, "", ""};
  Readers readers = readers_of(model, items, graph_nodes);
  fold_swiglus(model, items, graph_nodes, readers, fused);
  fold_norms(graph_nodes, readers, fused);
  if (matmul && specrt_matmul_int8_runs()) fold_int8(model, items, graph_nodes, readers, fused);
  matmuls += fused.int8;
  std::string new_graph;
  for (size_t k = 0; k < items.size(); ++k) {
    const auto placed = fused.placed.find(k);
    const size_t at = placed != fused.placed.end() ? placed->second : k;  // the node written here
    if (placed == fused.placed.end() && fused.dropped.count(k)) continue;
    if (!renamed[at] && !fused.matmuls.count(at)) {
      new_graph.append(model, items[at].begin, items[at].end - items[at].begin);
      continue;
    }
    const auto rewrite = fused.matmuls.find(at);
    const bool matmul_node = rewrite != fused.matmuls.end();
    const bool new_op = matmul_node && !rewrite->second.op.empty();
    std::string node;  // NodeProto: every field as it was but the domain (7), a matmul's inputs (1), outputs (2), op (4)
    for (const Field &f : fields(model, items[at].value, items[at].end))
      if (f.number != 7 && !(matmul_node && (f.number == 1 || f.number == 2)) && !(new_op && f.number == 4))
        node.append(model, f.begin, f.end - f.begin);
    if (matmul_node) {
      for (const std::string &in : rewrite->second.inputs) put_bytes(node, 1, in);
      for (const std::string &out : rewrite->second.outputs) put_bytes(node, 2, out);
      node += rewrite->second.attributes;
    }
    if (new_op) put_bytes(node, 4, rewrite->second.op);
    put_bytes(node, 7, kDomain);
    put_bytes(new_graph, 1, node);
  }
  std::string out;
  for (const Field &f : top) {
    if (&f == graph) put_bytes(out, 7, new_graph);
    else out.append(model, f.begin, f.end - f.begin);
  }
  std::string opset;  // OperatorSetIdProto: domain 1, version 2
  put_bytes(opset, 1, kDomain);
  put_varint(opset, (2u << 3) | 0);
  put_varint(opset, 1);
  put_bytes(out, 8, opset);
  return out;
}

void register_kernel(Ort::SessionOptions &options) {
  if (OrtStatus *status = RegisterCustomOps(options, ort_api_base()); status != nullptr) {
    const std::string message = Ort::GetApi().GetErrorMessage(status);
    Ort::GetApi().ReleaseStatus(status);
    throw RuntimeFailure("cannot register specrt's attention kernel: " + message);
  }
}

}  // namespace specrt::impl
