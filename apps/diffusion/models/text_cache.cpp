#include "models/text_cache.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include <flame/io/safetensors.h>

namespace flame_diffusion::models {
namespace {

namespace fs = std::filesystem;
constexpr const char* kOp = "TextEmbeddingCache";
constexpr const char* kVersionKey = "flame_text_cache";
constexpr const char* kVersion = "1";

// 64-bit FNV-1a.
struct Fnv64 {
  uint64_t h = 0xcbf29ce484222325ull;
  void bytes(const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  }
  void str(const std::string& s) {
    const uint64_t n = s.size();
    bytes(&n, sizeof(n));
    bytes(s.data(), s.size());
  }
};

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// 128-bit FNV-1a of the length-prefixed fields, as 32 hex digits.
std::string key_of(const std::string& caption, const std::string& identity, const std::string& settings) {
  using u128 = unsigned __int128;
  const u128 prime = (static_cast<u128>(1) << 88) + 0x13b;
  u128 h = (static_cast<u128>(0x6c62272e07bb0142ull) << 64) | 0x62b821756295c58dull;
  auto feed = [&](const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * prime;
  };
  for (const std::string* s : {&caption, &identity, &settings}) {
    const uint64_t n = s->size();
    feed(&n, sizeof(n));
    feed(s->data(), s->size());
  }
  return hex64(static_cast<uint64_t>(h >> 64)) + hex64(static_cast<uint64_t>(h));
}

// The checksum an entry's metadata carries: its strings, then each tensor's name, dtype, shape, bytes.
std::string entry_checksum(const std::string& caption, const std::string& identity, const std::string& settings,
                           const flame::StateDict& tensors) {
  Fnv64 f;
  f.str(caption);
  f.str(identity);
  f.str(settings);
  for (const std::string& name : tensors.keys()) {
    const flame::Tensor& t = tensors.at(name);
    f.str(name);
    f.str(flame::io::safetensors_dtype(t.dtype()));
    for (int64_t s : t.sizes()) f.bytes(&s, sizeof(s));
    flame::Tensor c = t.to(flame::Device::cpu()).contiguous();
    f.bytes(c.data_ptr(), c.nbytes());
  }
  return hex64(f.h);
}

std::string shape_text(const flame::Tensor& t) {
  std::ostringstream s;
  s << '[';
  bool first = true;
  for (int64_t d : t.sizes()) {
    s << (first ? "" : ", ") << d;
    first = false;
  }
  return s.str() + ']';
}

std::string short_caption(const std::string& c) { return c.size() <= 60 ? c : c.substr(0, 57) + "..."; }

struct IndexEntry {
  uint64_t bytes = 0;
  std::string checksum;
};

std::unordered_map<std::string, IndexEntry> read_index(const fs::path& p) {
  std::unordered_map<std::string, IndexEntry> out;
  std::ifstream in(p);
  for (std::string line; std::getline(in, line);) {
    std::istringstream ls(line);
    std::string key, checksum;
    uint64_t bytes = 0;
    if (ls >> key >> bytes >> checksum && key.size() == 32) out[key] = {bytes, checksum};
  }
  return out;
}

// A name no other writer (process, thread, earlier call) uses, beside `final_path`.
std::string temp_name(const fs::path& final_path) {
  static std::atomic<uint64_t> counter{0};
  std::ostringstream s;
  s << final_path.string() << ".tmp." << ::getpid() << '.' << std::hash<std::thread::id>{}(std::this_thread::get_id())
    << '.' << counter.fetch_add(1);
  return s.str();
}

}  // namespace

const char* cache_entry_state_name(CacheEntryState s) {
  switch (s) {
    case CacheEntryState::kValid: return "valid";
    case CacheEntryState::kMissing: return "missing";
    case CacheEntryState::kStale: return "stale";
    case CacheEntryState::kCorrupt: return "corrupt";
  }
  return "?";
}

struct TextEmbeddingCache::Impl {
  fs::path dir;
  std::string dir_text;
  std::string identity, settings;
  mutable std::mutex mu;
  std::unordered_map<std::string, IndexEntry> index;
  mutable std::vector<std::string> problems;

  fs::path path_of_key(const std::string& key) const { return dir / key.substr(0, 2) / (key + ".safetensors"); }

  // Reads and verifies one entry (Note [Text embedding cache]); the tensors go to `out` when valid.
  CacheEntryState read(const std::string& caption, const std::string& key, flame::StateDict* out,
                       std::string* why) const {
    const fs::path p = path_of_key(key);
    std::error_code ec;
    const uint64_t size = fs::file_size(p, ec);
    if (ec) return CacheEntryState::kMissing;
    auto fail = [&](CacheEntryState s, const std::string& reason) {
      if (why) *why = reason;
      return s;
    };
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = index.find(key);
      if (it != index.end() && it->second.bytes != size) {
        return fail(CacheEntryState::kCorrupt, "the file has " + std::to_string(size) + " bytes, the index says " +
                                                   std::to_string(it->second.bytes));
      }
    }
    try {
      flame::io::SafetensorsFile f(p.string());
      const flame::io::Metadata& md = f.metadata();
      for (const char* k : {kVersionKey, "caption", "encoder", "settings", "tensors", "checksum"}) {
        if (!md.count(k)) return fail(CacheEntryState::kCorrupt, std::string("its metadata has no \"") + k + "\"");
      }
      if (md.at(kVersionKey) != kVersion) {
        return fail(CacheEntryState::kCorrupt, "cache format " + md.at(kVersionKey) + ", expected " + kVersion);
      }
      if (md.at("tensors") != std::to_string(f.names().size())) {
        return fail(CacheEntryState::kCorrupt, "it holds " + std::to_string(f.names().size()) +
                                                   " tensors, its metadata says " + md.at("tensors"));
      }
      flame::StateDict sd;
      for (const std::string& name : f.names()) sd.insert(name, f.load(name));
      const std::string sum = entry_checksum(md.at("caption"), md.at("encoder"), md.at("settings"), sd);
      if (sum != md.at("checksum")) {
        return fail(CacheEntryState::kCorrupt, "checksum " + sum + " does not match the stored " + md.at("checksum"));
      }
      if (md.at("caption") != caption || md.at("encoder") != identity || md.at("settings") != settings) {
        return fail(CacheEntryState::kStale, "written for caption \"" + short_caption(md.at("caption")) +
                                                 "\", encoder \"" + md.at("encoder") + "\", settings \"" +
                                                 md.at("settings") + "\"");
      }
      if (out) *out = std::move(sd);
      return CacheEntryState::kValid;
    } catch (const flame::Error& e) {
      return fail(CacheEntryState::kCorrupt, e.what());
    }
  }

  void write(const std::string& caption, const std::string& key, const flame::StateDict& row) {
    const fs::path final_path = path_of_key(key);
    fs::create_directories(final_path.parent_path());
    const std::string sum = entry_checksum(caption, identity, settings, row);
    flame::io::Metadata md{{kVersionKey, kVersion},
                           {"caption", caption},
                           {"encoder", identity},
                           {"settings", settings},
                           {"tensors", std::to_string(row.size())},
                           {"checksum", sum}};
    const std::string tmp = temp_name(final_path);
    flame::io::save_safetensors(tmp, row, md);
    std::error_code ec;
    fs::rename(tmp, final_path, ec);
    if (ec) fs::remove(tmp);
    FLAME_CHECK(!ec, kOp, "cannot rename ", tmp, " to ", final_path.string(), ": ", ec.message());
    const uint64_t bytes = fs::file_size(final_path);
    std::lock_guard<std::mutex> lock(mu);
    index[key] = {bytes, sum};
  }

  // Merges the on-disk index with this one (ours win), leaves out `drop`, and replaces it atomically.
  void save_index(const std::vector<std::string>& drop = {}) {
    const fs::path p = dir / "index.tsv";
    std::unordered_map<std::string, IndexEntry> merged = read_index(p);
    {
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& [k, e] : index) merged[k] = e;
    }
    for (const std::string& k : drop) merged.erase(k);
    const std::string tmp = temp_name(p);
    {
      std::ofstream out(tmp);
      for (const auto& [k, e] : merged) out << k << '\t' << e.bytes << '\t' << e.checksum << '\n';
      FLAME_CHECK(out.good(), kOp, "writing ", tmp, " failed");
    }
    std::error_code ec;
    fs::rename(tmp, p, ec);
    if (ec) fs::remove(tmp);
    FLAME_CHECK(!ec, kOp, "cannot rename ", tmp, " to ", p.string(), ": ", ec.message());
  }

  void report(const std::string& key, CacheEntryState s, const std::string& why) const {
    std::lock_guard<std::mutex> lock(mu);
    problems.push_back(path_of_key(key).string() + ": " + cache_entry_state_name(s) + " (" + why + ")");
  }
};

TextEmbeddingCache::TextEmbeddingCache(std::string dir, std::string encoder_identity, std::string settings)
    : impl_(std::make_shared<Impl>()) {
  FLAME_CHECK(!dir.empty(), kOp, "the cache folder must not be empty");
  impl_->dir = dir;
  impl_->dir_text = dir;
  impl_->identity = std::move(encoder_identity);
  impl_->settings = std::move(settings);
  std::error_code ec;
  fs::create_directories(impl_->dir, ec);
  FLAME_CHECK(fs::is_directory(impl_->dir), kOp, "cannot create the cache folder ", dir,
              ec ? ": " + ec.message() : std::string());
  impl_->index = read_index(impl_->dir / "index.tsv");
}

const std::string& TextEmbeddingCache::dir() const { return impl_->dir_text; }

std::string TextEmbeddingCache::key(const std::string& caption) const {
  return key_of(caption, impl_->identity, impl_->settings);
}

std::string TextEmbeddingCache::path_of(const std::string& caption) const {
  return impl_->path_of_key(key(caption)).string();
}

CacheEntryState TextEmbeddingCache::check(const std::string& caption, std::string* why) const {
  return impl_->read(caption, key(caption), nullptr, why);
}

TextCacheStats TextEmbeddingCache::build(const std::vector<std::string>& captions, const TextEncodeFn& encode,
                                         int64_t batch_size) {
  FLAME_CHECK(batch_size >= 1, kOp, "batch_size must be >= 1, got ", batch_size);
  FLAME_CHECK(static_cast<bool>(encode), kOp, "build needs an encode callback");
  TextCacheStats stats;
  std::vector<const std::string*> todo;
  std::unordered_set<std::string> seen;
  for (const std::string& c : captions) {
    if (!seen.insert(c).second) continue;
    const std::string k = key(c);
    std::string why;
    const CacheEntryState s = impl_->read(c, k, nullptr, &why);
    switch (s) {
      case CacheEntryState::kValid: ++stats.hits; continue;
      case CacheEntryState::kMissing: ++stats.missing; break;
      case CacheEntryState::kStale: ++stats.stale; break;
      case CacheEntryState::kCorrupt: ++stats.corrupt; break;
    }
    if (s != CacheEntryState::kMissing) impl_->report(k, s, why);
    todo.push_back(&c);
  }
  for (size_t start = 0; start < todo.size(); start += static_cast<size_t>(batch_size)) {
    const size_t n = std::min(todo.size() - start, static_cast<size_t>(batch_size));
    std::vector<std::string> batch;
    for (size_t i = 0; i < n; ++i) batch.push_back(*todo[start + i]);
    TextTensors out = encode(batch);
    ++stats.batches;
    FLAME_CHECK(!out.empty(), kOp, "the encoder returned no tensors for a batch of ", n, " captions");
    std::map<std::string, flame::Tensor> host;
    for (const auto& [name, t] : out) {
      FLAME_CHECK(t.defined() && t.dim() >= 1 && t.size(0) == static_cast<int64_t>(n), kOp, "the encoder's \"", name,
                  "\" has shape ", t.defined() ? shape_text(t) : "(undefined)", " for a batch of ", n,
                  " captions: every output needs the batch as dim 0");
      host[name] = t.to(flame::Device::cpu());
    }
    for (size_t i = 0; i < n; ++i) {
      flame::StateDict row;
      for (const auto& [name, t] : host) row.insert(name, t.select(0, static_cast<int64_t>(i)).contiguous());
      impl_->write(batch[i], key(batch[i]), row);
      ++stats.encoded;
    }
  }
  if (!todo.empty()) impl_->save_index();
  return stats;
}

TextTensors TextEmbeddingCache::get(const std::string& caption, flame::Device device) const {
  flame::StateDict sd;
  std::string why;
  const std::string k = key(caption);
  const CacheEntryState s = impl_->read(caption, k, &sd, &why);
  if (s != CacheEntryState::kValid && s != CacheEntryState::kMissing) impl_->report(k, s, why);
  FLAME_CHECK(s == CacheEntryState::kValid, kOp, "caption \"", short_caption(caption), "\": entry ",
              impl_->path_of_key(k).string(), " is ", cache_entry_state_name(s), why.empty() ? "" : " (" + why + ")",
              "; run build() (or get_or_encode) with the encoder to fill it");
  TextTensors out;
  for (const std::string& name : sd.keys()) out[name] = sd.at(name).to(device);
  return out;
}

TextTensors TextEmbeddingCache::get_batch(const std::vector<std::string>& captions, flame::Device device) const {
  FLAME_CHECK(!captions.empty(), kOp, "get_batch needs at least one caption");
  std::map<std::string, std::vector<flame::Tensor>> parts;
  for (size_t i = 0; i < captions.size(); ++i) {
    TextTensors one = get(captions[i], flame::Device::cpu());
    if (i > 0) {
      FLAME_CHECK(one.size() == parts.size(), kOp, "caption \"", short_caption(captions[i]), "\" has ", one.size(),
                  " tensors, the first caption ", parts.size());
    }
    for (auto& [name, t] : one) {
      auto& v = parts[name];
      FLAME_CHECK(v.empty() || v.front().sizes() == t.sizes(), kOp, "\"", name, "\" of caption \"",
                  short_caption(captions[i]), "\" has shape ", shape_text(t), ", the first caption's ",
                  shape_text(v.front()), ": pad to one length before caching to batch them");
      v.push_back(t);
    }
    FLAME_CHECK(parts.size() == one.size(), kOp, "caption \"", short_caption(captions[i]),
                "\" holds tensors the first caption does not");
  }
  TextTensors out;
  for (auto& [name, v] : parts) out[name] = flame::stack(v, 0).to(device);
  return out;
}

TextTensors TextEmbeddingCache::get_or_encode(const std::vector<std::string>& captions, const TextEncodeFn& encode,
                                              flame::Device device, int64_t batch_size, TextCacheStats* stats) {
  TextCacheStats s = build(captions, encode, batch_size);
  if (stats) *stats = s;
  return get_batch(captions, device);
}

std::vector<std::string> TextEmbeddingCache::scan_foreign(bool remove) {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(impl_->dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (!it->is_regular_file() || it->path().extension() != ".safetensors") continue;
    flame::io::Metadata md;
    try {
      md = flame::io::load_safetensors_metadata(it->path().string());
    } catch (const flame::Error&) {
      continue;  // corrupt files are found (and replaced) when their caption is looked up
    }
    const bool ours = md.count("encoder") && md.at("encoder") == impl_->identity && md.count("settings") &&
                      md.at("settings") == impl_->settings;
    if (ours) continue;
    out.push_back(it->path().string());
  }
  if (remove && !out.empty()) {
    std::vector<std::string> keys;
    {
      std::lock_guard<std::mutex> lock(impl_->mu);
      for (const std::string& p : out) {
        fs::remove(p);
        keys.push_back(fs::path(p).stem().string());
        impl_->index.erase(keys.back());
      }
    }
    impl_->save_index(keys);
  }
  return out;
}

std::vector<std::string> TextEmbeddingCache::problems() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->problems;
}

}  // namespace flame_diffusion::models
