// Checkpoint: gathering the training state into one dict, saving it with its metadata, and the
// all-or-nothing load.
//
// Note [Checkpoint format]
// One safetensors file. Tensor keys are "<component>.<key>" in registration order, then
// "rng.<generator>.seed" / "rng.<generator>.offset" (u64 values stored bit for bit in i64), then
// "progress.step" and "progress.<counter>". "__metadata__" holds "format": "pt" (what
// Python's safetensors expects of PyTorch tensors) and "flame.checkpoint", a JSON object:
//   {"format_version": 1, "step": 1200,
//    "components": [{"name": "model", "type": "module"}, {"name": "optimizer", "type": "stateful"},
//                   {"name": "rng", "type": "rng"}, {"name": "progress", "type": "progress"}],
//    "generators": ["default"], "checksum": "flame-mr64",
//    "checksums": {"model.fc.weight": "3f0c...", ...}, "metadata": {"run": "a"}}
// A component with an empty state is listed and has no keys. A reader refuses a format_version
// newer than its own.
//
// Note [Checkpoint checksums]
// Each tensor's bytes get a 64-bit hash: four lanes, each folding 8-byte words with a multiply
// and a rotate (an invertible step, so any single changed word changes the result), combined with
// the length and a final avalanche. Fast enough to run at memory speed; not cryptographic. Load
// recomputes it from the bytes read, so a damaged file is named with the key that is wrong.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "flame/checkpoint.h"
#include "flame/error.h"
#include "flame/io/safetensors.h"
#include "src/train/checkpoint_detail.h"

namespace flame {

namespace {

using Json = nlohmann::ordered_json;
constexpr int64_t kFormatVersion = 1;
constexpr const char* kMetaKey = "flame.checkpoint";
constexpr const char* kHashName = "flame-mr64";

uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
uint64_t fold(uint64_t h, uint64_t w) { return rotl(h ^ (w * 0x9E3779B97F4A7C15ull), 29) * 0xBF58476D1CE4E5B9ull; }

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

bool valid_name(const std::string& n) {
  if (n.empty()) return false;
  for (char c : n) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

Tensor i64_scalar(int64_t v) { return Tensor::scalar(v, DType::i64); }
Tensor u64_as_i64(uint64_t v) {
  int64_t s;
  std::memcpy(&s, &v, sizeof s);
  return i64_scalar(s);
}
uint64_t i64_as_u64(const Tensor& t) {
  const int64_t s = t.item<int64_t>();
  uint64_t v;
  std::memcpy(&v, &s, sizeof v);
  return v;
}
bool is_i64_scalar(const Tensor& t) { return t.defined() && t.dtype() == DType::i64 && t.dim() == 0; }

Tensor host_contiguous(const Tensor& t) {
  return t.device().is_cpu() ? t.detach().contiguous() : t.detach().contiguous().to(Device::cpu());
}
// A host copy that nothing else aliases (rollback snapshots).
StateDict host_clone(const StateDict& sd) {
  StateDict out;
  for (const auto& [k, t] : sd) {
    if (!t.defined()) {
      out.insert(k, t);
      continue;
    }
    out.insert(k, t.device().is_cpu() ? t.detach().clone() : t.detach().to(Device::cpu()));
  }
  return out;
}

uint64_t tensor_hash(const Tensor& host) { return checkpoint_detail::content_hash(host.data_ptr(), host.nbytes()); }

// Parses and checks the "flame.checkpoint" JSON of an open file.
struct ParsedMeta {
  CheckpointInfo info;
  std::vector<std::pair<std::string, std::string>> components;  // (name, type)
  std::vector<std::string> generators;
  std::map<std::string, std::string> checksums;
};

ParsedMeta parse_meta(const io::SafetensorsFile& f, const char* op) {
  const std::string& path = f.path();
  const auto it = f.metadata().find(kMetaKey);
  FLAME_CHECK(it != f.metadata().end(), op, "'", path, "' is a safetensors file but not a FLAME checkpoint (no '",
              kMetaKey, "' metadata)");
  ParsedMeta m;
  m.info.path = path;
  try {
    const Json j = Json::parse(it->second);
    FLAME_CHECK(j.is_object(), op, "'", path, "': the checkpoint metadata is not a JSON object");
    m.info.format_version = j.at("format_version").get<int64_t>();
    FLAME_CHECK(m.info.format_version >= 1 && m.info.format_version <= kFormatVersion, op, "'", path,
                "' has checkpoint format_version ", m.info.format_version, "; this FLAME reads 1 to ", kFormatVersion);
    m.info.step = j.at("step").get<int64_t>();
    for (const Json& c : j.at("components")) {
      m.components.emplace_back(c.at("name").get<std::string>(), c.at("type").get<std::string>());
      m.info.components.push_back(m.components.back().first);
    }
    for (const Json& g : j.at("generators")) m.generators.push_back(g.get<std::string>());
    FLAME_CHECK(j.at("checksum").get<std::string>() == kHashName, op, "'", path, "': unknown checksum '",
                j.at("checksum").get<std::string>(), "'");
    for (const auto& el : j.at("checksums").items()) m.checksums[el.key()] = el.value().get<std::string>();
    for (const auto& el : j.at("metadata").items()) m.info.metadata[el.key()] = el.value().get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    FLAME_FAIL(op, "'", path, "': the checkpoint metadata is malformed: ", e.what());
  }
  std::set<std::string> seen;
  for (const auto& [name, type] : m.components) {
    FLAME_CHECK(seen.insert(name).second, op, "'", path, "': component '", name, "' is listed twice");
  }
  // Every tensor belongs to a listed component and has a checksum, and every checksum a tensor.
  for (const std::string& key : f.names()) {
    const std::string comp = key.substr(0, key.find('.'));
    FLAME_CHECK(key.find('.') != std::string::npos && seen.count(comp), op, "'", path, "': tensor '", key,
                "' belongs to no component of the checkpoint");
    FLAME_CHECK(m.checksums.count(key), op, "'", path, "': tensor '", key, "' has no checksum");
  }
  FLAME_CHECK(m.checksums.size() == f.names().size(), op, "'", path, "': the metadata lists ", m.checksums.size(),
              " checksums for ", f.names().size(), " tensors");
  return m;
}

io::SafetensorsFile open_checkpoint(const std::string& path, const char* op) {
  try {
    return io::SafetensorsFile(path);
  } catch (const Error& e) {
    FLAME_FAIL(op, "cannot read checkpoint '", path, "': ", e.what());
  }
}

}  // namespace

namespace checkpoint_detail {

uint64_t content_hash(const void* data, std::size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t lane[4] = {0x243F6A8885A308D3ull, 0x13198A2E03707344ull, 0xA4093822299F31D0ull, 0x082EFA98EC4E6C89ull};
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int l = 0; l < 4; ++l) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * l, 8);
      lane[l] = fold(lane[l], w);
    }
  }
  int l = 0;
  for (; i < n; i += 8, l = (l + 1) % 4) {
    uint64_t w = 0;
    std::memcpy(&w, p + i, std::min<std::size_t>(8, n - i));
    lane[l] = fold(lane[l], w);
  }
  uint64_t h = fold(static_cast<uint64_t>(n), lane[0]);
  for (int k = 1; k < 4; ++k) h = fold(h, lane[k]);
  h ^= h >> 31;
  h *= 0x94D049BB133111EBull;
  h ^= h >> 29;
  return h;
}

}  // namespace checkpoint_detail

// ---- TrainingProgress ----

StateDict TrainingProgress::state_dict() const {
  StateDict sd;
  sd.insert("step", i64_scalar(step));
  for (const auto& [k, v] : counters) sd.insert(k, i64_scalar(v));
  return sd;
}

void TrainingProgress::load_state_dict(const StateDict& state) {
  for (const auto& [k, t] : state) {
    FLAME_CHECK(is_i64_scalar(t), "TrainingProgress::load_state_dict", "key '", k,
                "' must be a 0-dim i64 tensor, got ", t.defined() ? dtype_name(t.dtype()) : "undefined", " ",
                t.defined() ? t.sizes() : Shape{});
  }
  const int64_t s = state.at("step").item<int64_t>();
  std::map<std::string, int64_t> c;
  for (const auto& [k, t] : state) {
    if (k != "step") c[k] = t.item<int64_t>();
  }
  step = s;
  counters = std::move(c);
}

// ---- Checkpoint ----

Checkpoint::Checkpoint() = default;

void Checkpoint::check_name(const std::string& name) const {
  FLAME_CHECK(valid_name(name), "Checkpoint::add", "component name '", name,
              "' must be letters, digits, '_' or '-' (keys are '<name>.<key>')");
  FLAME_CHECK(name != "rng" && name != "progress", "Checkpoint::add", "component name '", name,
              "' is the checkpoint's own");
  for (const auto& c : components_) {
    FLAME_CHECK(c.name != name, "Checkpoint::add", "component '", name, "' is already registered");
  }
}

Checkpoint& Checkpoint::add(const std::string& name, nn::Module& module, bool strict) {
  check_name(name);
  components_.push_back({name, &module, nullptr, strict});
  return *this;
}

Checkpoint& Checkpoint::add(const std::string& name, Stateful& component) {
  check_name(name);
  components_.push_back({name, nullptr, &component, true});
  return *this;
}

Checkpoint& Checkpoint::add_generator(const std::string& name, Generator& gen) {
  FLAME_CHECK(valid_name(name), "Checkpoint::add_generator", "generator name '", name,
              "' must be letters, digits, '_' or '-'");
  FLAME_CHECK(name != "default", "Checkpoint::add_generator",
              "'default' is default_generator(), included unless exclude_default_generator()");
  for (const auto& [n, g] : generators_) {
    FLAME_CHECK(n != name, "Checkpoint::add_generator", "generator '", name, "' is already registered");
  }
  generators_.emplace_back(name, &gen);
  return *this;
}

Checkpoint& Checkpoint::exclude_default_generator() {
  include_default_generator_ = false;
  return *this;
}

namespace {
std::vector<std::pair<std::string, Generator*>> all_generators(
    bool with_default, const std::vector<std::pair<std::string, Generator*>>& extra) {
  std::vector<std::pair<std::string, Generator*>> out;
  if (with_default) out.emplace_back("default", &default_generator());
  out.insert(out.end(), extra.begin(), extra.end());
  return out;
}
}  // namespace

StateDict Checkpoint::state_dict() const {
  StateDict out;
  for (const auto& c : components_) {
    const StateDict sd = c.module ? c.module->state_dict() : c.stateful->state_dict();
    for (const auto& [k, t] : sd) {
      FLAME_CHECK(t.defined(), "Checkpoint::save", "component '", c.name, "' gave an undefined tensor for key '", k, "'");
      out.insert(c.name + "." + k, t);
    }
  }
  for (const auto& [n, g] : all_generators(include_default_generator_, generators_)) {
    const Generator::State s = g->get_state();
    out.insert("rng." + n + ".seed", u64_as_i64(s.seed));
    out.insert("rng." + n + ".offset", u64_as_i64(s.offset));
  }
  for (const auto& [k, t] : progress_.state_dict()) out.insert("progress." + k, t);
  return out;
}

void Checkpoint::save(const std::string& path) const {
  try {
    save_unchecked(path);
  } catch (const Error& e) {
    FLAME_FAIL("Checkpoint::save", "saving '", path, "' failed (the previous file, if any, is untouched): ", e.what());
  }
}

void Checkpoint::save_unchecked(const std::string& path) const {
  const StateDict sd = state_dict();
  StateDict host;
  Json checksums = Json::object();
  for (const auto& [k, t] : sd) {
    Tensor h = host_contiguous(t);
    checksums[k] = hex64(tensor_hash(h));
    host.insert(k, std::move(h));
  }
  Json j;
  j["format_version"] = kFormatVersion;
  j["step"] = progress_.step;
  Json comps = Json::array();
  for (const auto& c : components_) comps.push_back({{"name", c.name}, {"type", c.module ? "module" : "stateful"}});
  const auto gens = all_generators(include_default_generator_, generators_);
  if (!gens.empty()) comps.push_back({{"name", "rng"}, {"type", "rng"}});
  comps.push_back({{"name", "progress"}, {"type", "progress"}});
  j["components"] = comps;
  Json gnames = Json::array();
  for (const auto& [n, g] : gens) gnames.push_back(n);
  j["generators"] = gnames;
  j["checksum"] = kHashName;
  j["checksums"] = checksums;
  Json user = Json::object();
  for (const auto& [k, v] : metadata_) user[k] = v;
  j["metadata"] = user;
  checkpoint_detail::atomic_save(path, host, {{"format", "pt"}, {kMetaKey, j.dump()}});
}

CheckpointInfo read_checkpoint_info(const std::string& path) {
  const io::SafetensorsFile f = open_checkpoint(path, "read_checkpoint_info");
  return parse_meta(f, "read_checkpoint_info").info;
}

CheckpointInfo Checkpoint::load(const std::string& path, const CheckpointLoadOptions& options) {
  const char* op = "Checkpoint::load";
  const io::SafetensorsFile f = open_checkpoint(path, op);
  ParsedMeta meta = parse_meta(f, op);
  CheckpointInfo info = meta.info;

  // ---- which components: registered vs in the file ----
  const auto gens = all_generators(include_default_generator_, generators_);
  std::map<std::string, std::string> in_file(meta.components.begin(), meta.components.end());
  std::vector<std::string> registered;
  for (const auto& c : components_) registered.push_back(c.name);
  if (!gens.empty()) registered.push_back("rng");
  registered.push_back("progress");
  for (const std::string& n : registered) {
    if (!in_file.count(n)) info.missing_components.push_back(n);
  }
  for (const auto& [n, type] : meta.components) {
    if (std::find(registered.begin(), registered.end(), n) == registered.end()) info.unexpected_components.push_back(n);
  }
  for (const auto& [n, g] : gens) {
    const bool there = std::find(meta.generators.begin(), meta.generators.end(), n) != meta.generators.end();
    if (in_file.count("rng") && !there) info.missing_components.push_back("rng." + n);
  }
  for (const std::string& n : meta.generators) {
    const bool mine = std::any_of(gens.begin(), gens.end(), [&](const auto& g) { return g.first == n; });
    if (!mine) info.unexpected_components.push_back("rng." + n);
  }
  if (options.strict && (!info.missing_components.empty() || !info.unexpected_components.empty())) {
    std::ostringstream os;
    for (const auto& n : info.missing_components) os << "\n  missing from the file: " << n;
    for (const auto& n : info.unexpected_components) os << "\n  in the file but not registered: " << n;
    FLAME_FAIL(op, "'", path, "' does not hold the components registered (nothing was changed):", os.str());
  }
  for (const auto& c : components_) {
    if (!in_file.count(c.name)) continue;
    const std::string want = c.module ? "module" : "stateful";
    FLAME_CHECK(in_file[c.name] == want, op, "'", path, "': component '", c.name, "' is a ", in_file[c.name],
                " in the file, registered as a ", want);
  }

  // ---- read every tensor, checking its checksum ----
  std::map<std::string, StateDict> parts;  // component -> its dict, keys without the prefix
  for (const std::string& key : f.names()) {
    const std::size_t dot = key.find('.');
    const std::string comp = key.substr(0, dot);
    Tensor t;
    try {
      t = f.load(key, Device::cpu());
    } catch (const Error& e) {
      FLAME_FAIL(op, "'", path, "': cannot read tensor '", key, "': ", e.what());
    }
    if (options.verify_checksums) {
      const std::string got = hex64(tensor_hash(t));
      FLAME_CHECK(got == meta.checksums.at(key), op, "'", path, "': tensor '", key, "' fails its checksum (stored ",
                  meta.checksums.at(key), ", computed ", got, "): the file is damaged");
    }
    parts[comp].insert(key.substr(dot + 1), std::move(t));
  }
  auto part = [&](const std::string& name) -> const StateDict& {
    static const StateDict empty;
    const auto it = parts.find(name);
    return it == parts.end() ? empty : it->second;
  };

  // ---- validate what can be validated without changing anything ----
  for (const auto& c : components_) {
    if (!c.module || !c.strict || !in_file.count(c.name)) continue;
    const StateDict mine = c.module->state_dict();
    const StateDict& got = part(c.name);
    std::ostringstream os;
    for (const auto& [k, t] : mine) {
      const Tensor* g = got.find(k);
      if (!g) {
        os << "\n  missing key '" << c.name << "." << k << "'";
      } else if (g->sizes() != t.sizes() || g->dtype() != t.dtype()) {
        os << "\n  key '" << c.name << "." << k << "': the file has " << dtype_name(g->dtype()) << " "
           << shape_str(g->sizes()) << ", the module " << dtype_name(t.dtype()) << " " << shape_str(t.sizes());
      }
    }
    for (const auto& [k, t] : got) {
      if (!mine.contains(k)) os << "\n  unexpected key '" << c.name << "." << k << "'";
    }
    const std::string problems = os.str();
    FLAME_CHECK(problems.empty(), op, "'", path, "': module '", c.name, "' does not match (nothing was changed):",
                problems);
  }
  std::vector<std::pair<Generator*, Generator::State>> rng_states;
  if (in_file.count("rng")) {
    const StateDict& r = part("rng");
    for (const auto& [n, g] : gens) {
      const Tensor* seed = r.find(n + ".seed");
      const Tensor* offset = r.find(n + ".offset");
      if (!seed && !offset && !options.strict) continue;  // reported as missing
      FLAME_CHECK(seed && offset && is_i64_scalar(*seed) && is_i64_scalar(*offset), op, "'", path, "': keys 'rng.", n,
                  ".seed' and 'rng.", n, ".offset' must be 0-dim i64 tensors");
      rng_states.emplace_back(g, Generator::State{i64_as_u64(*seed), i64_as_u64(*offset)});
    }
  }
  TrainingProgress progress = progress_;
  if (in_file.count("progress")) {
    try {
      progress.load_state_dict(part("progress"));
    } catch (const Error& e) {
      FLAME_FAIL(op, "'", path, "': component 'progress': ", e.what());
    }
  }

  // ---- Stateful components: each validates itself; earlier ones are put back on a refusal ----
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < components_.size(); ++i) {
    if (components_[i].stateful && in_file.count(components_[i].name)) order.push_back(i);
  }
  std::vector<std::pair<Stateful*, StateDict>> undo;
  for (std::size_t n = 0; n < order.size(); ++n) {
    const Component& c = components_[order[n]];
    StateDict sd;
    for (const auto& [k, t] : part(c.name)) sd.insert(k, options.map_location.is_cpu() ? t : t.to(options.map_location));
    // The last one needs no snapshot: nothing after it can refuse.
    StateDict snapshot = n + 1 < order.size() ? host_clone(c.stateful->state_dict()) : StateDict{};
    try {
      c.stateful->load_state_dict(sd);
    } catch (const Error& e) {
      std::string restore_failure;
      for (auto it = undo.rbegin(); it != undo.rend(); ++it) {
        try {
          it->first->load_state_dict(it->second);
        } catch (const Error& re) {
          restore_failure += std::string("\n  and restoring an earlier component failed: ") + re.what();
        }
      }
      FLAME_FAIL(op, "'", path, "': component '", c.name, "' refused its state (keys '", c.name,
                 ".*'; nothing was changed): ", e.what(), restore_failure);
    }
    undo.emplace_back(c.stateful, std::move(snapshot));
  }

  // ---- the rest cannot fail any more ----
  for (const auto& c : components_) {
    if (!c.module || !in_file.count(c.name)) continue;
    nn::LoadReport report = c.module->load_state_dict(part(c.name), c.strict);
    if (!c.strict) info.module_reports[c.name] = std::move(report);
  }
  for (const auto& [g, s] : rng_states) g->set_state(s);
  progress_ = std::move(progress);
  metadata_ = info.metadata;
  return info;
}

}  // namespace flame
