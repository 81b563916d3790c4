#include "models/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <unordered_map>

#include <flame/nn/linear.h>
#include <nlohmann/json.hpp>

namespace flame_diffusion::models {

namespace fs = std::filesystem;
using flame::DType;
using flame::Shape;
using flame::Tensor;
using nlohmann::json;

// ---------------------------------------------------------------- JsonConfig

struct JsonConfig::Impl {
  std::string origin;
  json root = json::object();
};

JsonConfig::JsonConfig() : impl_(std::make_shared<Impl>()) {}

JsonConfig JsonConfig::parse(const std::string& text, const std::string& origin) {
  auto impl = std::make_shared<Impl>();
  impl->origin = origin;
  try {
    impl->root = json::parse(text);
  } catch (const json::exception& e) {
    FLAME_FAIL("config", origin, " is not valid JSON: ", e.what());
  }
  FLAME_CHECK(impl->root.is_object(), "config", origin, " must hold a JSON object, found ", impl->root.type_name());
  JsonConfig c;
  c.impl_ = std::move(impl);
  return c;
}

JsonConfig JsonConfig::from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  FLAME_CHECK(in.good(), "config", "cannot open ", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return parse(ss.str(), path);
}

const std::string& JsonConfig::origin() const { return impl_->origin; }

bool JsonConfig::has(const std::string& key) const {
  auto it = impl_->root.find(key);
  return it != impl_->root.end() && !it->is_null();
}

std::vector<std::string> JsonConfig::keys() const {
  std::vector<std::string> out;
  for (auto it = impl_->root.begin(); it != impl_->root.end(); ++it) out.push_back(it.key());
  return out;
}

namespace {

const json& require(const JsonConfig::Impl& impl, const std::string& key) {
  auto it = impl.root.find(key);
  FLAME_CHECK(it != impl.root.end() && !it->is_null(), "config", impl.origin, ": key \"", key,
              "\" is missing (give it in the config)");
  return *it;
}

[[noreturn]] void wrong_type(const JsonConfig::Impl& impl, const std::string& key, const char* want, const json& v) {
  FLAME_FAIL("config", impl.origin, ": key \"", key, "\" must be ", want, ", found ", v.type_name(), " ", v.dump());
}

int64_t as_int(const JsonConfig::Impl& impl, const std::string& key, const json& v) {
  if (v.is_number_unsigned()) {  // above int64's range it is no size or count any config means
    if (v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      wrong_type(impl, key, "an integer within int64's range", v);
    return static_cast<int64_t>(v.get<uint64_t>());
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  // 2.0 is accepted as 2 (some configs are written by float-happy tools); 2.5 is not, and neither is
  // a value outside int64's range (converting it would be undefined).
  if (v.is_number_float()) {
    const double d = v.get<double>(), two63 = std::ldexp(1.0, 63);  // int64 holds [-2^63, 2^63)
    if (std::isfinite(d) && std::trunc(d) == d && d >= -two63 && d < two63) return static_cast<int64_t>(d);
  }
  wrong_type(impl, key, "an integer", v);
}
double as_double(const JsonConfig::Impl& impl, const std::string& key, const json& v) {
  if (!v.is_number()) wrong_type(impl, key, "a number", v);
  return v.get<double>();
}
template <class T, class F>
std::vector<T> as_list(const JsonConfig::Impl& impl, const std::string& key, const json& v, const char* want, F&& one) {
  if (!v.is_array()) wrong_type(impl, key, want, v);
  std::vector<T> out;
  for (const json& e : v) {
    try {
      out.push_back(one(e));
    } catch (const flame::Error&) {
      wrong_type(impl, key, want, v);
    }
  }
  return out;
}

}  // namespace

int64_t JsonConfig::get_int(const std::string& key) const { return as_int(*impl_, key, require(*impl_, key)); }
int64_t JsonConfig::get_int(const std::string& key, int64_t fallback) const {
  return has(key) ? get_int(key) : fallback;
}
double JsonConfig::get_double(const std::string& key) const { return as_double(*impl_, key, require(*impl_, key)); }
double JsonConfig::get_double(const std::string& key, double fallback) const {
  return has(key) ? get_double(key) : fallback;
}
std::optional<double> JsonConfig::get_optional_double(const std::string& key) const {
  if (!has(key)) return std::nullopt;
  return get_double(key);
}
bool JsonConfig::get_bool(const std::string& key) const {
  const json& v = require(*impl_, key);
  if (!v.is_boolean()) wrong_type(*impl_, key, "true or false", v);
  return v.get<bool>();
}
bool JsonConfig::get_bool(const std::string& key, bool fallback) const { return has(key) ? get_bool(key) : fallback; }
std::string JsonConfig::get_string(const std::string& key) const {
  const json& v = require(*impl_, key);
  if (!v.is_string()) wrong_type(*impl_, key, "a string", v);
  return v.get<std::string>();
}
std::string JsonConfig::get_string(const std::string& key, const std::string& fallback) const {
  return has(key) ? get_string(key) : fallback;
}
std::vector<int64_t> JsonConfig::get_ints(const std::string& key) const {
  const Impl& impl = *impl_;
  return as_list<int64_t>(impl, key, require(impl, key), "a list of integers",
                          [&](const json& e) { return as_int(impl, key, e); });
}
std::vector<int64_t> JsonConfig::get_ints(const std::string& key, const std::vector<int64_t>& fallback) const {
  return has(key) ? get_ints(key) : fallback;
}
std::vector<double> JsonConfig::get_doubles(const std::string& key, const std::vector<double>& fallback) const {
  if (!has(key)) return fallback;
  const Impl& impl = *impl_;
  return as_list<double>(impl, key, require(impl, key), "a list of numbers",
                         [&](const json& e) { return as_double(impl, key, e); });
}
std::vector<std::string> JsonConfig::get_strings(const std::string& key,
                                                 const std::vector<std::string>& fallback) const {
  if (!has(key)) return fallback;
  const Impl& impl = *impl_;
  return as_list<std::string>(impl, key, require(impl, key), "a list of strings", [&](const json& e) {
    if (!e.is_string()) FLAME_FAIL("config", "not a string");
    return e.get<std::string>();
  });
}

// ---------------------------------------------------------------- Checkpoint

struct Checkpoint::Impl {
  std::string path;
  bool single_file = true;
  std::optional<JsonConfig> config;
  std::vector<flame::io::SafetensorsFile> files;
  std::vector<std::string> file_paths;
  std::vector<std::string> keys;
  std::unordered_map<std::string, std::size_t> file_index;  // key -> files[i]
};

namespace {

constexpr const char* kWeights = "diffusion_pytorch_model";
constexpr const char* kTransformersWeights = "model";

bool is_safetensors_path(const fs::path& p) { return p.extension() == ".safetensors"; }

// The weights of a diffusers model folder: a full file or an index of shards, by variant preference.
std::vector<std::string> folder_weight_files(const fs::path& dir, const std::string& variant, std::string* tried) {
  std::vector<std::string> names;  // candidate stems in preference order
  // diffusers' names first, then transformers' (a text encoder folder: model.safetensors, or
  // model-0000i-of-0000N.safetensors listed by model.safetensors.index.json).
  for (const char* stem : {kWeights, kTransformersWeights}) {
    const std::string plain = stem;
    if (variant.empty()) {
      names.insert(names.end(), {plain, plain + ".fp16"});
    } else {
      names.insert(names.end(), {plain + "." + variant, plain});
    }
  }
  for (const std::string& stem : names) {
    const fs::path full = dir / (stem + ".safetensors");
    const fs::path index = dir / (stem + ".safetensors.index.json");
    *tried += " " + full.filename().string() + ", " + index.filename().string() + ";";
    if (fs::is_regular_file(full)) return {full.string()};
    if (fs::is_regular_file(index)) {
      std::ifstream in(index);
      json root = json::parse(in, nullptr, false);
      FLAME_CHECK(!root.is_discarded() && root.is_object(), "checkpoint", index.string(), " is not valid JSON");
      FLAME_CHECK(root.contains("weight_map") && root["weight_map"].is_object(), "checkpoint", index.string(),
                  ": \"weight_map\" must be an object {tensor name: shard file}");
      std::vector<std::string> shards;
      for (auto it = root["weight_map"].begin(); it != root["weight_map"].end(); ++it) {
        FLAME_CHECK(it->is_string(), "checkpoint", index.string(), ": weight_map[\"", it.key(), "\"] must be a file name");
        const std::string f = (dir / it->get<std::string>()).string();
        if (std::find(shards.begin(), shards.end(), f) == shards.end()) shards.push_back(f);
      }
      FLAME_CHECK(!shards.empty(), "checkpoint", index.string(), " lists no shards");
      for (const std::string& f : shards)
        FLAME_CHECK(fs::is_regular_file(f), "checkpoint", index.string(), " lists shard ", f,
                    ", which does not exist (an incomplete download?)");
      return shards;
    }
  }
  // A folder with exactly one .safetensors file of another name (e.g. a converted model).
  std::vector<std::string> any;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && is_safetensors_path(e.path())) any.push_back(e.path().string());
  if (any.size() == 1) return any;
  return {};
}

}  // namespace

Checkpoint Checkpoint::open(const std::string& path_in, const OpenOptions& options) {
  auto impl = std::make_shared<Impl>();
  fs::path p(path_in);
  FLAME_CHECK(fs::exists(p), "checkpoint", path_in, " does not exist");
  std::vector<std::string> paths;
  if (fs::is_directory(p)) {
    std::string tried;
    fs::path dir = p;
    paths = folder_weight_files(dir, options.variant, &tried);
    if (paths.empty() && !options.subfolder.empty() && fs::is_directory(p / options.subfolder)) {
      dir = p / options.subfolder;
      tried += " then in " + dir.string() + ":";
      paths = folder_weight_files(dir, options.variant, &tried);
    }
    FLAME_CHECK(!paths.empty(), "checkpoint", path_in,
                " holds no model weights (looked for", tried,
                " a pipeline folder needs its subfolder: vae/, unet/ ...; or point at a .safetensors file)");
    impl->path = dir.string();
    impl->single_file = false;
    const fs::path config = dir / "config.json";
    if (fs::is_regular_file(config)) impl->config = JsonConfig::from_file(config.string());
  } else {
    FLAME_CHECK(is_safetensors_path(p), "checkpoint", path_in,
                " is not a .safetensors file (pickled .ckpt/.bin/.pt files are not read: convert them to "
                "safetensors first)");
    paths = {path_in};
    impl->path = path_in;
  }
  for (const std::string& f : paths) {
    impl->files.emplace_back(f);  // maps the file and validates its header (errors name the file)
    impl->file_paths.push_back(f);
    const std::size_t fi = impl->files.size() - 1;
    for (const std::string& k : impl->files.back().names()) {
      auto [it, fresh] = impl->file_index.emplace(k, fi);
      FLAME_CHECK(fresh, "checkpoint", "tensor \"", k, "\" is stored twice: in ", impl->file_paths[it->second],
                  " and in ", f);
      impl->keys.push_back(k);
    }
  }
  Checkpoint c;
  c.impl_ = std::move(impl);
  return c;
}

const std::string& Checkpoint::path() const { return impl_->path; }
std::string Checkpoint::description() const {
  if (impl_->single_file) return "single file " + impl_->path;
  std::string s = "diffusers folder " + impl_->path;
  if (impl_->files.size() > 1) s += " (" + std::to_string(impl_->files.size()) + " shards)";
  return s;
}
bool Checkpoint::is_single_file() const { return impl_->single_file; }
const std::vector<std::string>& Checkpoint::files() const { return impl_->file_paths; }
const JsonConfig* Checkpoint::config() const { return impl_->config ? &*impl_->config : nullptr; }
const std::vector<std::string>& Checkpoint::keys() const { return impl_->keys; }
bool Checkpoint::contains(std::string_view key) const { return impl_->file_index.count(std::string(key)) != 0; }
bool Checkpoint::has_prefix(std::string_view prefix) const {
  for (const std::string& k : impl_->keys)
    if (k.compare(0, prefix.size(), prefix) == 0) return true;
  return false;
}
const flame::io::TensorInfo& Checkpoint::info(std::string_view key) const {
  auto it = impl_->file_index.find(std::string(key));
  FLAME_CHECK(it != impl_->file_index.end(), "checkpoint", description(), " has no tensor \"", key, "\"");
  return impl_->files[it->second].info(key);
}
const std::string& Checkpoint::file_of(std::string_view key) const {
  auto it = impl_->file_index.find(std::string(key));
  FLAME_CHECK(it != impl_->file_index.end(), "checkpoint", description(), " has no tensor \"", key, "\"");
  return impl_->file_paths[it->second];
}
Tensor Checkpoint::load(std::string_view key, flame::Device device, std::optional<DType> dtype) const {
  auto it = impl_->file_index.find(std::string(key));
  FLAME_CHECK(it != impl_->file_index.end(), "checkpoint", description(), " has no tensor \"", key, "\"");
  const flame::io::SafetensorsFile& f = impl_->files[it->second];
  const auto& stored = f.info(key).flame_dtype;
  if (dtype && stored && flame::is_floating(*dtype) && !flame::is_floating(*stored) && !flame::is_float8(*stored))
    dtype.reset();
  return f.load(key, device, dtype);
}

// ---------------------------------------------------------------- registry

namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, CheckpointFormat> formats;
};
Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

bool register_checkpoint_format(CheckpointFormat format) {
  FLAME_CHECK(!format.name.empty() && !format.kind.empty() && format.detect && format.plan,
              "register_checkpoint_format", "a format needs a name, a kind, a detector and a plan builder (got \"",
              format.name, "\", kind \"", format.kind, "\")");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.formats[format.name] = std::move(format);
  return true;
}

std::vector<std::string> checkpoint_format_names(const std::string& kind) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> out;
  for (const auto& [name, f] : r.formats)
    if (kind.empty() || f.kind == kind) out.push_back(name);
  return out;
}

namespace {
std::string join(const std::vector<std::string>& v, const std::string& sep = ", ") {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}
}  // namespace

CheckpointFormat checkpoint_format(const std::string& name) {
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.formats.find(name);
    if (it != r.formats.end()) return it->second;
  }
  FLAME_FAIL("checkpoint_format", "no format \"", name, "\" is registered (registered: ", join(checkpoint_format_names()),
             ")");
}

DetectedFormat detect_checkpoint_format(const Checkpoint& ck, const std::string& kind) {
  std::vector<CheckpointFormat> candidates;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (const auto& [name, f] : r.formats)
      if (f.kind == kind) candidates.push_back(f);
  }
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const CheckpointFormat& a, const CheckpointFormat& b) { return a.priority > b.priority; });
  for (const CheckpointFormat& f : candidates) {
    if (auto prefix = f.detect(ck)) return {f.name, *prefix};
  }
  std::vector<std::string> first;
  for (std::size_t i = 0; i < ck.keys().size() && i < 6; ++i) first.push_back(ck.keys()[i]);
  std::vector<std::string> tried;
  for (const auto& f : candidates) tried.push_back(f.name);
  FLAME_FAIL("checkpoint", ck.description(), " holds no ", kind, " in a layout FLAME knows (tried: ",
             tried.empty() ? std::string("no format of this kind is registered") : join(tried), "); its first keys: ",
             first.empty() ? std::string("(none: the file is empty)") : join(first),
             ". Is it a checkpoint of another model?");
}

KeyPlan identity_plan(const Checkpoint& ck, const std::string& prefix) {
  KeyPlan plan;
  plan.source_prefix = prefix;
  for (const std::string& k : ck.keys()) {
    if (k.compare(0, prefix.size(), prefix) != 0) continue;
    KeyPlanEntry e;
    e.target = k.substr(prefix.size());
    e.sources = {k};
    plan.entries.push_back(std::move(e));
  }
  return plan;
}

// ---------------------------------------------------------------- checking and loading

namespace {

int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// The shape an entry produces from the stored shapes, or an error text.
std::optional<Shape> entry_shape(const Checkpoint& ck, const KeyPlanEntry& e, std::string* why) {
  std::vector<Shape> in;
  for (const std::string& s : e.sources) {
    if (!ck.contains(s)) {
      *why = "missing: " + e.target + " needs stored key " + s + " (" + to_string(e.op) + ")";
      return std::nullopt;
    }
    in.push_back(ck.info(s).shape);
  }
  if (in.empty()) {
    *why = "plan: " + e.target + " has no source";
    return std::nullopt;
  }
  auto rank_ok = [&](const Shape& s) { return e.dim >= 0 && e.dim < static_cast<int64_t>(s.size()); };
  // kChunk / kSwapHalves: the optional second source is a one-element scale (key_plan.h).
  if ((e.op == KeyPlanEntry::Op::kChunk || e.op == KeyPlanEntry::Op::kSwapHalves) && in.size() == 2 &&
      numel(in[1]) != 1) {
    *why = "shape: " + e.target + " scales stored " + e.sources[0] + " by " + e.sources[1] + " " +
           flame::shape_str(in[1]) + ", which is not one element";
    return std::nullopt;
  }
  switch (e.op) {
    case KeyPlanEntry::Op::kCopy:
      return in[0];
    case KeyPlanEntry::Op::kReshape:
      if (numel(in[0]) != numel(e.shape)) {
        *why = "shape: " + e.target + " reshapes stored " + e.sources[0] + " " + flame::shape_str(in[0]) + " to " +
               flame::shape_str(e.shape) + ": element counts differ";
        return std::nullopt;
      }
      return e.shape;
    case KeyPlanEntry::Op::kConcat: {
      Shape out = in[0];
      if (!rank_ok(out)) break;
      for (std::size_t i = 1; i < in.size(); ++i) {
        Shape a = in[i], b = out;
        if (a.size() != b.size()) break;
        a[e.dim] = b[e.dim] = 0;
        if (a != b) {
          *why = "shape: " + e.target + " concatenates " + e.sources[0] + " " + flame::shape_str(in[0]) + " and " +
                 e.sources[i] + " " + flame::shape_str(in[i]) + " along dim " + std::to_string(e.dim) +
                 ": other dims differ";
          return std::nullopt;
        }
        out[e.dim] += in[i][e.dim];
      }
      return out;
    }
    case KeyPlanEntry::Op::kChunk: {
      Shape out = in[0];
      if (!rank_ok(out) || e.count < 1 || e.index < 0 || e.pieces < 1 || e.index + e.pieces > e.count) break;
      if (out[e.dim] % e.count != 0) {
        *why = "shape: " + e.target + " is piece " + std::to_string(e.index) + " of " + std::to_string(e.count) +
               " of stored " + e.sources[0] + " " + flame::shape_str(in[0]) + ", whose dim " + std::to_string(e.dim) +
               " does not divide";
        return std::nullopt;
      }
      out[e.dim] = out[e.dim] / e.count * e.pieces;
      return out;
    }
    case KeyPlanEntry::Op::kTranspose:
      if (in[0].size() != 2) break;
      return Shape{in[0][1], in[0][0]};
    case KeyPlanEntry::Op::kScale: {
      if (in.size() != 2) break;
      // The scale broadcasts to the weight: one element, or trailing dims that are 1 or equal.
      const Shape& w = in[0];
      const Shape& sc = in[1];
      bool fits = numel(sc) == 1;
      if (!fits && sc.size() <= w.size()) {
        fits = true;
        for (std::size_t i = 0; i < sc.size(); ++i) {
          const int64_t a = sc[sc.size() - 1 - i], b = w[w.size() - 1 - i];
          if (a != 1 && a != b) fits = false;
        }
      }
      if (!fits) {
        *why = "shape: " + e.target + " scales stored " + e.sources[0] + " " + flame::shape_str(w) + " by " +
               e.sources[1] + " " + flame::shape_str(sc) + ", which does not broadcast to it";
        return std::nullopt;
      }
      return w;
    }
    case KeyPlanEntry::Op::kSwapHalves:
      if (!rank_ok(in[0])) break;
      if (in[0][e.dim] % 2 != 0) {
        *why = "shape: " + e.target + " swaps the halves of stored " + e.sources[0] + " " + flame::shape_str(in[0]) +
               " along dim " + std::to_string(e.dim) + ", which is odd";
        return std::nullopt;
      }
      return in[0];
  }
  *why = "plan: " + e.target + " has a bad " + to_string(e.op) + " (dim " + std::to_string(e.dim) + ", index " +
         std::to_string(e.index) + " of " + std::to_string(e.count) + ") for stored " + e.sources[0] + " " +
         flame::shape_str(in[0]);
  return std::nullopt;
}

std::vector<std::string> unplaced_keys(const Checkpoint& ck, const KeyPlan& plan) {
  std::set<std::string> used;
  for (const KeyPlanEntry& e : plan.entries) used.insert(e.sources.begin(), e.sources.end());
  used.insert(plan.ignored.begin(), plan.ignored.end());
  std::vector<std::string> out;
  for (const std::string& k : ck.keys())
    if (k.compare(0, plan.source_prefix.size(), plan.source_prefix) == 0 && !used.count(k)) out.push_back(k);
  return out;
}

Tensor apply_entry(const Checkpoint& ck, const KeyPlanEntry& e, flame::Device device, DType dtype) {
  switch (e.op) {
    case KeyPlanEntry::Op::kCopy:
      return ck.load(e.sources[0], device, dtype);
    case KeyPlanEntry::Op::kReshape:
      return ck.load(e.sources[0], device, dtype).reshape(e.shape);
    case KeyPlanEntry::Op::kConcat: {
      flame::TensorList parts;
      for (const std::string& s : e.sources) parts.push_back(ck.load(s, device, dtype));
      return flame::cat(parts, e.dim);
    }
    case KeyPlanEntry::Op::kChunk:
      if (e.pieces > 1) {  // consecutive pieces: one narrow
        const bool scaled = e.sources.size() == 2;
        const Tensor all = ck.load(e.sources[0], device, scaled ? DType::f32 : dtype);
        const int64_t piece = all.size(e.dim) / e.count;
        const Tensor part = all.narrow(e.dim, e.index * piece, e.pieces * piece).contiguous();
        return scaled ? (part * ck.load(e.sources[1], device, DType::f32)).to(dtype) : part;
      }
      if (e.sources.size() == 2) {  // fp8-scaled: the piece of source * scale
        const Tensor piece =
            flame::chunk(ck.load(e.sources[0], device, DType::f32), e.count, e.dim)[static_cast<std::size_t>(e.index)];
        return (piece * ck.load(e.sources[1], device, DType::f32)).to(dtype);
      }
      return flame::chunk(ck.load(e.sources[0], device, dtype), e.count, e.dim)[static_cast<std::size_t>(e.index)];
    case KeyPlanEntry::Op::kSwapHalves: {
      const bool scaled = e.sources.size() == 2;
      const flame::TensorList h = flame::chunk(ck.load(e.sources[0], device, scaled ? DType::f32 : dtype), 2, e.dim);
      const Tensor swapped = flame::cat({h[1], h[0]}, e.dim);
      return scaled ? (swapped * ck.load(e.sources[1], device, DType::f32)).to(dtype) : swapped;
    }

    case KeyPlanEntry::Op::kTranspose:
      return ck.load(e.sources[0], device, dtype).t().contiguous();
    case KeyPlanEntry::Op::kScale:
      return (ck.load(e.sources[0], device, DType::f32) * ck.load(e.sources[1], device, DType::f32)).to(dtype);
  }
  FLAME_FAIL("load_checkpoint", "unknown plan op");
}

// An entry that moves whole rows of one 8-bit stored weight (a copy, a row split of a fused
// weight, a swap of row halves; with or without a one-element scale_weight): the codes as stored,
// moved the same way, and the per-row scale. nullopt for anything else (then it loads dense).
std::optional<std::pair<Tensor, Tensor>> float8_entry(const Checkpoint& ck, const KeyPlanEntry& e,
                                                      flame::Device device) {
  using Op = KeyPlanEntry::Op;
  const flame::io::TensorInfo& info = ck.info(e.sources[0]);
  if (!info.flame_dtype || !flame::is_float8(*info.flame_dtype) || info.shape.size() != 2) return std::nullopt;
  const bool row_op =
      e.op == Op::kCopy || e.op == Op::kScale || ((e.op == Op::kChunk || e.op == Op::kSwapHalves) && e.dim == 0);
  if (!row_op || e.sources.size() > 2 || (e.op == Op::kScale && e.sources.size() != 2)) return std::nullopt;
  const bool has_scale = e.sources.size() == 2;
  if (has_scale) {  // one scale_weight for the whole stored tensor; a wider one loads dense
    int64_t n = 1;
    for (int64_t d : ck.info(e.sources[1]).shape) n *= d;
    if (n != 1) return std::nullopt;
  }
  const Tensor all = ck.load(e.sources[0], device, *info.flame_dtype);
  Tensor q;
  switch (e.op) {
    case Op::kChunk: {
      const int64_t piece = all.size(0) / e.count;
      q = all.narrow(0, e.index * piece, e.pieces * piece).contiguous();
      break;
    }
    case Op::kSwapHalves: {
      const int64_t h = all.size(0) / 2;
      q = Tensor::empty(all.sizes(), flame::TensorOptions(all.dtype(), device));
      q.narrow(0, 0, h).copy_(all.narrow(0, h, h));
      q.narrow(0, h, h).copy_(all.narrow(0, 0, h));
      break;
    }
    default: q = all;
  }
  const Tensor scale = has_scale ? ck.load(e.sources[1], device, DType::f32).reshape({1})
                                 : Tensor::ones({1}, flame::TensorOptions(DType::f32, device));
  return std::make_pair(q, scale);
}

}  // namespace

std::vector<std::pair<std::string, Shape>> planned_shapes(const Checkpoint& ck, const KeyPlan& plan) {
  std::vector<std::pair<std::string, Shape>> out;
  for (const KeyPlanEntry& e : plan.entries) {
    std::string why;
    auto s = entry_shape(ck, e, &why);
    FLAME_CHECK(s.has_value(), "checkpoint", ck.description(), ": ", why);
    out.emplace_back(e.target, *s);
  }
  return out;
}

std::vector<std::string> check_checkpoint(const flame::nn::Module& module, const Checkpoint& ck, const KeyPlan& plan,
                                          bool allow_unplaced) {
  std::vector<std::string> problems;
  const flame::StateDict sd = module.state_dict();
  std::set<std::string> targets;
  for (const KeyPlanEntry& e : plan.entries) {
    if (!targets.insert(e.target).second) {
      problems.push_back("plan: " + e.target + " is produced twice");
      continue;
    }
    std::string why;
    auto shape = entry_shape(ck, e, &why);
    if (!shape) {
      problems.push_back(why);
      continue;
    }
    const Tensor* p = sd.find(e.target);
    if (!p) {
      problems.push_back("unplaced: stored " + join(e.sources) + " maps to " + e.target +
                         ", which the model does not have");
      continue;
    }
    if (p->sizes() != *shape) {
      problems.push_back("shape: " + e.target + " expects " + flame::shape_str(p->sizes()) + ", stored " +
                         join(e.sources) + " gives " + flame::shape_str(*shape));
    }
  }
  for (const auto& [name, t] : sd) {
    if (!targets.count(name)) problems.push_back("missing: the model's " + name + " " + flame::shape_str(t.sizes()) +
                                                 " is in no stored key");
  }
  if (!allow_unplaced) {
    for (const std::string& k : unplaced_keys(ck, plan))
      problems.push_back("unplaced: stored " + k + " " + flame::shape_str(ck.info(k).shape) + " maps to no parameter");
  }
  return problems;
}

void load_checkpoint(flame::nn::Module& module, const Checkpoint& ck, const KeyPlan& plan,
                     const LoadCheckpointOptions& options) {
  const std::vector<std::string> problems = check_checkpoint(module, ck, plan, options.allow_unplaced);
  if (!problems.empty()) {
    // Group by kind so the first unplaced and missing keys both show, however many there are.
    std::ostringstream os;
    os << ck.description() << " does not fit the model";
    if (!options.family.empty()) os << " (guessed family " << options.family;
    if (!options.format.empty()) os << (options.family.empty() ? " (" : ", ") << "layout " << options.format;
    if (!options.family.empty() || !options.format.empty()) {
      if (!plan.source_prefix.empty()) os << ", keys under \"" << plan.source_prefix << "\"";
      os << ")";
    }
    os << ": " << problems.size() << " problem" << (problems.size() == 1 ? "" : "s");
    std::map<std::string, int> shown;
    std::map<std::string, int> hidden;
    for (const std::string& p : problems) {
      const std::string kind = p.substr(0, p.find(':'));
      if (shown[kind] < 6) {
        os << "\n  " << p;
        ++shown[kind];
      } else {
        ++hidden[kind];
      }
    }
    for (const auto& [kind, n] : hidden) os << "\n  ... and " << n << " more " << kind;
    os << "\n(pick the family or layout explicitly if the guess is wrong; a file of another model does not load)";
    FLAME_FAIL("load_checkpoint", os.str());
  }
  flame::NoGradGuard no_grad;
  const flame::StateDict sd = module.state_dict();
  std::map<std::string, flame::nn::Linear*> linears;  // "<path>.weight" -> its Linear
  if (options.float8) {
    for (const auto& [name, m] : module.named_modules())
      if (auto* l = dynamic_cast<flame::nn::Linear*>(m.get())) linears[name.empty() ? "weight" : name + ".weight"] = l;
  }
  for (const KeyPlanEntry& e : plan.entries) {
    if (options.float8) {
      const auto it = linears.find(e.target);
      if (it != linears.end()) {
        if (auto q = float8_entry(ck, e, it->second->weight().device())) {
          it->second->set_float8_weight(q->first, q->second, *options.float8);
          continue;
        }
      }
    }
    Tensor dst = sd.at(e.target);
    Tensor src = apply_entry(ck, e, dst.device(), dst.dtype());
    dst.copy_(src);
  }
  if (options.float8) {  // the Linears whose weights were not stored in 8 bits
    for (auto& [key, l] : linears) {
      if (options.float8_device) l->to(*options.float8_device);
      if (l->is_float8()) continue;
      Tensor w = l->weight();
      w.requires_grad_(false);
      l->to_float8(*options.float8);
    }
  }
}

}  // namespace flame_diffusion::models
