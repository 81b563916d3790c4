#pragma once
// The text-embedding cache: a data set's captions are encoded once and each caption's outputs
// (hidden states, pooled vectors, masks: any named tensors) are stored as one safetensors file, so a
// trainer reads them back instead of keeping the text encoders in GPU memory.
//
// Note [Text embedding cache]
// - Key: 128-bit FNV-1a of (caption, encoder identity, settings), each length-prefixed; the file is
//   <dir>/<key[0:2]>/<key>.safetensors. The identity names the encoder and its weights
//   ("clip-l sd15 <checkpoint hash>"), the settings whatever changes its outputs ("max_length=77
//   layer=-2 dtype=bf16"); both are the caller's strings.
// - Each file's metadata repeats caption, identity and settings, the tensor count and a checksum
//   (64-bit FNV-1a over those strings, every tensor's name, dtype, shape and bytes). Reading checks
//   all of it: a file that does not open, is shorter or longer than the index says, or fails the
//   checksum is corrupt; a sound file written for another caption/identity/settings is stale. Both
//   are reported (problems()) and re-encoded by get_or_encode/build.
// - Index: <dir>/index.tsv (key, file size, checksum per line) is loaded when the cache opens and
//   rewritten after each build; lookups are one hash-map probe, and a key absent from the index is
//   still found on disk (another process may have written it): the files are authoritative.
// - Writes are atomic: a file is written under a unique temporary name (pid, thread, counter) in
//   the same folder and renamed over its final name, so a crash never leaves a half file under a
//   key's name, and processes or threads encoding the same captions at once do not clash (the last
//   rename wins; both files are valid).
// - Encoding: the caller's callback takes a batch of captions and returns name -> tensor with the
//   batch as dim 0; the cache splits the rows, stores them on the CPU, and reads them back to any
//   device. The API knows nothing of the encoders.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <flame/flame.h>

namespace flame_diffusion::models {

// name -> tensor; from the encoder with a batch dim 0, from the cache per caption (no batch dim)
// or stacked again (get_batch).
using TextTensors = std::map<std::string, flame::Tensor>;
using TextEncodeFn = std::function<TextTensors(const std::vector<std::string>& captions)>;

enum class CacheEntryState { kValid, kMissing, kStale, kCorrupt };
const char* cache_entry_state_name(CacheEntryState s);

struct TextCacheStats {
  int64_t hits = 0;
  int64_t missing = 0;
  int64_t stale = 0;
  int64_t corrupt = 0;
  int64_t encoded = 0;  // captions sent to the encoder (unique ones)
  int64_t batches = 0;  // encoder calls
};

class TextEmbeddingCache {
 public:
  // Creates `dir` if needed and loads its index.
  TextEmbeddingCache(std::string dir, std::string encoder_identity, std::string settings);

  const std::string& dir() const;
  std::string key(const std::string& caption) const;  // 32 hex digits
  std::string path_of(const std::string& caption) const;

  // The state of a caption's entry; `why` gets a one-line reason for stale/corrupt ones.
  CacheEntryState check(const std::string& caption, std::string* why = nullptr) const;
  // Encodes every caption that is not valid (missing, stale or corrupt: each stale/corrupt one is
  // reported in problems()), `batch_size` unique captions per encoder call, and writes them.
  // Raises flame::Error when the encoder's output is not name -> [batch, ...] for its batch.
  TextCacheStats build(const std::vector<std::string>& captions, const TextEncodeFn& encode, int64_t batch_size = 32);
  // One caption's tensors on `device`. Raises flame::Error naming the caption's file and the problem
  // when the entry is not valid.
  TextTensors get(const std::string& caption, flame::Device device = flame::Device::cpu()) const;
  // The captions' tensors stacked along a new dim 0 (every caption's entries must agree in names and
  // shapes).
  TextTensors get_batch(const std::vector<std::string>& captions, flame::Device device = flame::Device::cpu()) const;
  // build() for these captions, then get_batch().
  TextTensors get_or_encode(const std::vector<std::string>& captions, const TextEncodeFn& encode,
                            flame::Device device = flame::Device::cpu(), int64_t batch_size = 32,
                            TextCacheStats* stats = nullptr);

  // Every entry file under dir() whose identity or settings differ from this cache's (written for
  // another encoder or other settings), as paths; with `remove`, deleted as well.
  std::vector<std::string> scan_foreign(bool remove = false);
  // Stale or corrupt entries met so far: "<path>: <reason>", one per line.
  std::vector<std::string> problems() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace flame_diffusion::models
