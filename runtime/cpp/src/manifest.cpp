// manifest.json validation: the checks of engines/manifest.py, in the same order, with the same
// messages (Python's repr formatting included), plus type checks Python leaves to its own errors.
#include "manifest.h"

#include <sys/stat.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "error.h"

namespace specrt::impl {
namespace {

using json = nlohmann::ordered_json;  // keeps the file's key order, as Python's dict does

bool is_dir(const std::string &p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool is_file(const std::string &p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string join(const std::string &dir, const std::string &name) {
  if (name.empty() || name == ".") return dir;
  return dir == "/" ? "/" + name : dir + "/" + name;
}

// pathlib.Path's str(): no trailing slash, "a//b" -> "a/b", "./x" -> "x".
std::string normalize(std::string p) {
  std::string out;
  for (size_t i = 0; i < p.size(); ++i)
    if (!(p[i] == '/' && !out.empty() && out.back() == '/')) out += p[i];
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  while (out.rfind("./", 0) == 0 && out.size() > 2) out = out.substr(2);
  return out.empty() ? "." : out;
}

std::string py_str(const std::string &s) {  // repr of a str
  bool single = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  char q = single ? '"' : '\'';
  std::string out(1, q);
  for (char c : s) {
    if (c == '\\' || c == q) out += '\\';
    if (c == '\n') { out += "\\n"; continue; }
    out += c;
  }
  return out + q;
}

std::string py_repr(const json &v) {
  if (v.is_string()) return py_str(v.get<std::string>());
  if (v.is_null()) return "None";
  if (v.is_boolean()) return v.get<bool>() ? "True" : "False";
  if (v.is_number_float()) {
    std::string s = v.dump();
    return s.find_first_of(".eE") == std::string::npos ? s + ".0" : s;
  }
  if (v.is_number()) return v.dump();
  std::string out;
  if (v.is_array()) {
    for (const auto &x : v) out += (out.empty() ? "" : ", ") + py_repr(x);
    return "[" + out + "]";
  }
  for (const auto &[k, x] : v.items()) out += (out.empty() ? "" : ", ") + py_str(k) + ": " + py_repr(x);
  return "{" + out + "}";
}

[[noreturn]] void fail(const std::string &msg) { throw EngineError(msg); }

const json &require(const json &d, const std::string &key, const std::string &where) {
  if (!d.is_object() || !d.contains(key)) fail("manifest.json: missing field " + where + py_str(key));
  return d.at(key);
}

int as_int(const json &v, const std::string &what) {
  if (!v.is_number_integer()) fail("manifest.json: " + what + " must be an integer, got " + py_repr(v));
  return v.get<int>();
}

std::string as_str(const json &v, const std::string &what) {
  if (!v.is_string()) fail("manifest.json: " + what + " must be a string, got " + py_repr(v));
  return v.get<std::string>();
}

std::vector<TensorSpec> tensors(const json &list, const std::string &what) {
  std::vector<TensorSpec> out;
  if (!list.is_array()) fail("manifest.json: " + what + " must be a list, got " + py_repr(list));
  for (const auto &t : list) {
    if (!t.is_object() || !t.contains("name")) fail("manifest.json: every entry of " + what + " needs a name");
    TensorSpec s{t["name"].is_string() ? t["name"].get<std::string>() : py_repr(t["name"]),
                 t.value("dtype", json()).is_string() ? t["dtype"].get<std::string>() : "", {}};
    if (t.contains("shape") && t["shape"].is_array())
      for (const auto &d : t["shape"]) s.shape.push_back(py_repr(d));
    out.push_back(s);
  }
  return out;
}

GraphSpec graph(const std::string &root, const std::string &role, const json &m) {
  const std::string where = "models." + role + ".";
  GraphSpec g;
  g.role = role;
  g.architecture = as_str(require(m, "architecture", where), where + "architecture");
  g.num_layers = as_int(require(m, "num_layers", where), where + "num_layers");
  g.num_kv_heads = as_int(require(m, "num_kv_heads", where), where + "num_kv_heads");
  g.head_dim = as_int(require(m, "head_dim", where), where + "head_dim");
  g.hidden_size = as_int(require(m, "hidden_size", where), where + "hidden_size");
  g.vocab_size = as_int(require(m, "vocab_size", where), where + "vocab_size");
  const json &file = require(m, "file", where);
  const json &dtype = require(m, "dtype", where);
  g.has_hidden = m.contains("has_hidden") && m["has_hidden"].is_boolean() && m["has_hidden"].get<bool>();
  const json &shapes = require(m, "shapes", where);
  const json &inputs = require(m, "inputs", where), &outputs = require(m, "outputs", where);
  g.vocab_sha256 = as_str(require(m, "vocab_sha256", where), where + "vocab_sha256");
  if (m.contains("aux_hidden_layers") && !m["aux_hidden_layers"].is_null()) {
    const json &layers = m["aux_hidden_layers"];
    bool ok = layers.is_array() && !layers.empty();
    for (const auto &i : layers) ok = ok && i.is_number_integer() && i.get<int>() >= 0 && i.get<int>() < g.num_layers;
    if (!ok)
      fail("manifest.json: " + where + "aux_hidden_layers must be a non-empty list of layer indices in 0.." +
           std::to_string(g.num_layers - 1) + ", got " + py_repr(layers));
    g.aux_hidden_layers = layers.get<std::vector<int>>();
  }
  g.file = as_str(file, where + "file");
  if (!is_file(join(root, g.file))) fail("engine dir " + root + ": " + role + " graph file " + py_str(g.file) + " is missing");
  if (!dtype.is_string() || (dtype != "fp32" && dtype != "fp16"))
    fail("manifest.json: " + where + "dtype must be fp32 or fp16, got " + py_repr(dtype));
  g.dtype = dtype.get<std::string>();
  json layout = m.contains("kv_layout") ? m["kv_layout"] : json("time_major");
  if (!layout.is_string() || (layout != "time_major" && layout != "in_place"))
    fail("manifest.json: " + where + "kv_layout must be one of ['time_major', 'in_place'], got " + py_repr(layout));
  g.kv_layout = layout.get<std::string>();
  g.inputs = tensors(inputs, where + "inputs");
  g.outputs = tensors(outputs, where + "outputs");
  std::vector<std::string> in_names, out_names;
  for (const auto &t : g.inputs) in_names.push_back(t.name);
  for (const auto &t : g.outputs) out_names.push_back(t.name);
  if (in_names != contract_inputs(g.num_layers, g.kv_layout) ||
      out_names != contract_outputs(g.num_layers, g.has_hidden, g.kv_layout, g.aux_hidden_layers.has_value()))
    fail("manifest.json: " + where + "inputs/outputs do not match the graph contract for " +
         std::to_string(g.num_layers) + " layers (see docs/engine-format.md)");
  if (m.contains("decode_file") && !m["decode_file"].is_null()) {
    g.decode_file = as_str(m["decode_file"], where + "decode_file");
    if (!is_file(join(root, g.decode_file)))
      fail("engine dir " + root + ": " + role + " graph file " + py_str(g.decode_file) + " is missing");
    if (g.kv_layout != "in_place") fail("manifest.json: " + where + "decode_file is for kv_layout in_place graphs only");
  }
  if (m.contains("prefill_file") && !m["prefill_file"].is_null()) {
    g.prefill_file = as_str(m["prefill_file"], where + "prefill_file");
    if (!is_file(join(root, g.prefill_file)))
      fail("engine dir " + root + ": " + role + " graph file " + py_str(g.prefill_file) + " is missing");
    if (g.kv_layout != "in_place") fail("manifest.json: " + where + "prefill_file is for kv_layout in_place graphs only");
  }
  if (shapes.is_object() && shapes.contains("prefill")) g.prefill_chunk = as_int(shapes["prefill"], where + "shapes.prefill");
  if (g.prefill_chunk < 1) fail("manifest.json: " + where + "shapes.prefill must be >= 1");
  if (m.contains("sliding_window") && !m["sliding_window"].is_null())
    g.sliding_window = as_int(m["sliding_window"], where + "sliding_window");
  return g;
}

// The optional medusa / eagle sections: validated like the Python loader (this runtime does not run them).
void head_section(const std::string &root, const json &s, const GraphSpec &target, const std::string &section) {
  const bool medusa = section == "medusa";
  const std::string label = medusa ? "medusa heads" : "EAGLE head", w = section + ".";
  std::vector<std::string> names = medusa ? std::vector<std::string>{"file", "num_heads", "hidden_size", "vocab_size",
                                                                      "dtype", "tree", "inputs", "outputs"}
                                          : std::vector<std::string>{"file", "hidden_size", "vocab_size", "num_kv_heads",
                                                                      "head_dim", "dtype", "tree", "inputs", "outputs"};
  for (const auto &n : names) require(s, n, w);
  std::string file = as_str(s["file"], w + "file");
  if (!is_file(join(root, file))) fail("engine dir " + root + ": " + label + " graph file " + py_str(file) + " is missing");
  if (!target.has_hidden)
    fail("manifest.json: " + label + (medusa ? " need" : " needs") + " a target graph with the `hidden` output (has_hidden)");
  int h = as_int(s["hidden_size"], w + "hidden_size"), v = as_int(s["vocab_size"], w + "vocab_size");
  if (h != target.hidden_size || v != target.vocab_size)
    fail("manifest.json: " + label + " (hidden " + std::to_string(h) + ", vocab " + std::to_string(v) + ") " +
         (medusa ? "do" : "does") + " not match the target (hidden " + std::to_string(target.hidden_size) +
         ", vocab " + std::to_string(target.vocab_size) + ")");
  require(s["tree"], "nodes", w + "tree.");  // compared with the target's tree_verify shape by the caller
}

// The EAGLE-3 fields of the eagle section (version, fc_file, aux_hidden_layers).
void eagle3(const std::string &root, const json &s, const GraphSpec &target) {
  const json version = s.contains("version") ? s["version"] : json(1);
  if (version != 1 && version != 3) fail("manifest.json: eagle.version must be 1 or 3, got " + py_repr(version));
  if (version != 3) return;
  const json fc = s.contains("fc_file") ? s["fc_file"] : json();
  if (!fc.is_string() || fc.get<std::string>().empty() || !is_file(join(root, fc.get<std::string>())))
    fail("engine dir " + root + ": the EAGLE-3 fc graph file " + py_repr(fc) + " is missing");
  const json layers = s.contains("aux_hidden_layers") ? s["aux_hidden_layers"] : json();
  const json want = layers.is_null() ? json::array() : layers;
  std::string shown = "None";  // the target's layers as Python prints a tuple
  if (target.aux_hidden_layers) {
    shown.clear();
    for (int i : *target.aux_hidden_layers) shown += (shown.empty() ? "" : ", ") + std::to_string(i);
    shown = "(" + shown + (target.aux_hidden_layers->size() == 1 ? ",)" : ")");
  }
  if (!target.aux_hidden_layers || json(*target.aux_hidden_layers) != want)
    fail("manifest.json: the EAGLE-3 head fuses layers " + py_repr(layers) + " but the target outputs aux_hidden of layers " +
         shown);
}

}  // namespace

std::string py_list(const std::vector<std::string> &items, bool quote) {
  std::string out;
  for (const auto &s : items) out += (out.empty() ? "" : ", ") + (quote ? py_str(s) : s);
  return "[" + out + "]";
}

std::vector<std::string> contract_inputs(int num_layers, const std::string &kv_layout) {
  std::vector<std::string> v = {"input_ids", "position_ids", "attention_mask"};
  if (kv_layout == "in_place") v.insert(v.end(), {"seqlens_k", "total_sequence_length"});
  for (int i = 0; i < num_layers; ++i)
    for (const char *kv : {"key", "value"}) v.push_back(std::string("past_") + kv + "." + std::to_string(i));
  return v;
}

std::vector<std::string> contract_outputs(int num_layers, bool has_hidden, const std::string &kv_layout,
                                          bool has_aux) {
  std::vector<std::string> v = {"logits"};
  const char *prefix = kv_layout == "in_place" ? "present_" : "new_";
  for (int i = 0; i < num_layers; ++i)
    for (const char *kv : {"key", "value"}) v.push_back(std::string(prefix) + kv + "." + std::to_string(i));
  if (has_hidden) v.push_back("hidden");
  if (has_aux) v.push_back("aux_hidden");
  return v;
}

Manifest load_manifest(const std::string &engine_dir) {
  const std::string root = normalize(engine_dir);
  if (!is_dir(root)) fail("engine dir " + root + " does not exist or is not a directory");
  const std::string path = join(root, "manifest.json");
  if (!is_file(path)) fail("engine dir " + root + " has no manifest.json (export one with `specrt export`)");
  json raw;
  {
    std::ifstream in(path, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    try {
      raw = json::parse(text.str());
    } catch (const json::exception &e) {
      fail(path + " is not valid JSON: " + e.what());
    }
  }
  if (!raw.is_object() || !raw.contains("format") || raw["format"] != "specrt-engine")
    fail(path + " is not a specrt engine manifest (format != 'specrt-engine')");
  json version = raw.contains("schema_version") ? raw["schema_version"] : json();
  if (!version.is_number_integer() || (version != 1 && version != 2))
    fail(path + ": schema_version " + py_repr(version) +
         " is not supported by this specrt (supports 1, 2); re-export the engine or upgrade specrt");
  const json &models = require(raw, "models", "");
  if (!models.is_object() || !models.contains("target")) fail(path + ": models.target is missing");
  std::vector<std::string> unknown;
  for (const auto &[role, _] : models.items())
    if (role != "target" && role != "draft") unknown.push_back(role);
  if (!unknown.empty()) {
    std::sort(unknown.begin(), unknown.end());
    fail(path + ": unknown model roles " + py_list(unknown) + "; known: ['target', 'draft']");
  }
  Manifest m;
  m.root = root;
  for (const auto &[role, spec] : models.items()) m.graphs[role] = graph(root, role, spec);
  const json &tok = require(raw, "tokenizer", "");
  std::string tok_dir = normalize(join(root, as_str(require(tok, "dir", "tokenizer."), "tokenizer.dir")));
  if (!is_file(join(tok_dir, "tokenizer.json")))
    fail("engine dir " + root + ": tokenizer file " + join(tok_dir, "tokenizer.json") + " is missing");
  if (const GraphSpec *d = m.draft()) {
    const GraphSpec &t = m.target();
    if (t.vocab_size != d->vocab_size)
      fail("draft vocabulary differs from the target's: draft has " + std::to_string(d->vocab_size) + " logits, target " +
           std::to_string(t.vocab_size));
    if (t.vocab_sha256 != d->vocab_sha256)
      fail("draft vocabulary differs from the target's: same size but different tokenizer vocabularies (sha256 " +
           d->vocab_sha256.substr(0, 12) + " vs " + t.vocab_sha256.substr(0, 12) + ")");
  }
  const json &target_shapes = models["target"]["shapes"];
  json tree_verify = target_shapes.is_object() && target_shapes.contains("tree_verify") ? target_shapes["tree_verify"] : json();
  for (const std::string section : {"medusa", "eagle"}) {
    if (!raw.contains(section) || raw[section].is_null() || raw[section].empty() || raw[section] == false) continue;
    const json &s = raw[section];
    head_section(root, s, m.target(), section);
    const json &nodes = s["tree"]["nodes"];
    if (tree_verify != nodes)
      fail("manifest.json: " + section + ".tree has " + py_repr(nodes) + " nodes but models.target.shapes.tree_verify is " +
           py_repr(tree_verify));
    if (section == "medusa") {
      int depth = as_int(require(s["tree"], "depth", "medusa.tree."), "medusa.tree.depth");
      int heads = as_int(s["num_heads"], "medusa.num_heads");
      if (depth > heads)
        fail("manifest.json: medusa.tree is " + std::to_string(depth) + " deep but there are only " +
             std::to_string(heads) + " heads");
      m.has_medusa = true;
    } else {
      for (const char *key : {"depth", "topk"})
        if (as_int(require(s["tree"], key, "eagle.tree."), std::string("eagle.tree.") + key) < 1)
          fail(std::string("manifest.json: eagle.tree.") + key + " must be >= 1");
      eagle3(root, s, m.target());
      m.has_eagle = true;
    }
  }
  for (const auto &id : require(tok, "eos_token_ids", "tokenizer.")) m.eos_token_ids.push_back(as_int(id, "tokenizer.eos_token_ids"));
  m.max_len = as_int(require(raw, "max_len", ""), "max_len");
  m.gamma = as_int(require(raw, "gamma", ""), "gamma");
  const json defaults = raw.contains("defaults") && raw["defaults"].is_object() ? raw["defaults"] : json::object();
  if (defaults.contains("method") && defaults["method"].is_string()) m.default_method = defaults["method"].get<std::string>();
  if (defaults.contains("gamma") && !defaults["gamma"].is_null()) {
    const json &g = defaults["gamma"];
    if (!g.is_number_integer() || g.get<int>() < 0 || g.get<int>() > m.gamma)
      fail("manifest.json: defaults.gamma must be null (adaptive) or an integer in 0.." + std::to_string(m.gamma) +
           " (the exported gamma), got " + py_repr(g));
    m.default_gamma = g.get<int>();
  }
  return m;
}

}  // namespace specrt::impl
