#include "models/tokenizer_t5.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <unordered_map>

#include <sentencepiece_processor.h>
#include <utf8proc.h>

#include "models/tokenizer_util.h"

namespace flame_diffusion::models {
namespace {

constexpr const char* kOp = "T5Tokenizer";
constexpr const char* kMeta = "\xe2\x96\x81";  // U+2581, SentencePiece's word-start mark
constexpr double kUnkPenalty = 10.0;

// ---- protobuf wire format: just enough to reach ModelProto.normalizer_spec.precompiled_charsmap ----
bool read_varint(std::string_view buf, size_t& pos, uint64_t& v) {
  v = 0;
  for (int shift = 0; shift < 64 && pos < buf.size(); shift += 7) {
    const auto b = static_cast<unsigned char>(buf[pos++]);
    v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if (!(b & 0x80)) return true;
  }
  return false;
}

// The bytes of length-delimited field `field` of the message in `buf` (the last occurrence, as
// protobuf merges); nullopt when absent. False in `ok` for a malformed message.
std::optional<std::string_view> find_bytes_field(std::string_view buf, uint32_t field, bool& ok) {
  std::optional<std::string_view> found;
  size_t pos = 0;
  ok = true;
  while (pos < buf.size()) {
    uint64_t key = 0, v = 0;
    if (!read_varint(buf, pos, key)) return ok = false, std::nullopt;
    const uint32_t wire = key & 7;
    if (wire == 0) {
      if (!read_varint(buf, pos, v)) return ok = false, std::nullopt;
    } else if (wire == 1 || wire == 5) {
      pos += wire == 1 ? 8 : 4;
    } else if (wire == 2) {
      if (!read_varint(buf, pos, v) || v > buf.size() - pos) return ok = false, std::nullopt;
      if ((key >> 3) == field) found = buf.substr(pos, v);
      pos += v;
    } else {
      return ok = false, std::nullopt;
    }
  }
  if (pos != buf.size()) ok = false;
  return found;
}

// ---- the precompiled charsmap: a darts-clone double array of uint32 units, then NUL-terminated
// replacement strings; a key's value is the offset of its replacement ----
struct CharsMap {
  std::vector<uint32_t> units;
  std::string replacements;

  bool empty() const { return units.empty(); }

  // The replacement of the shortest key that prefixes `chunk`, if any.
  std::optional<std::string_view> shortest_prefix(std::string_view chunk) const {
    if (units.empty()) return std::nullopt;
    auto offset = [](uint32_t u) { return (u >> 10) << ((u & (1u << 9)) >> 6); };
    auto has_leaf = [](uint32_t u) { return ((u >> 8) & 1) != 0; };
    auto label = [](uint32_t u) { return u & ((1u << 31) | 0xff); };
    size_t node = offset(units[0]);
    for (unsigned char c : chunk) {
      node ^= c;
      if (node >= units.size()) return std::nullopt;
      const uint32_t u = units[node];
      if (label(u) != c) return std::nullopt;
      node ^= offset(u);
      if (node >= units.size()) return std::nullopt;
      if (has_leaf(u)) {  // the value sits in the unit the offset leads to
        const size_t value = units[node] & ((1u << 31) - 1);
        if (value >= replacements.size()) return std::nullopt;
        const char* s = replacements.data() + value;
        return std::string_view(s, strnlen(s, replacements.size() - value));
      }
    }
    return std::nullopt;
  }
};

CharsMap read_charsmap(std::string_view blob, const std::string& path) {
  CharsMap m;
  if (blob.empty()) return m;
  FLAME_CHECK(blob.size() >= 4, kOp, path, ": precompiled_charsmap of ", blob.size(), " bytes is truncated");
  uint32_t trie_bytes = 0;
  for (int i = 3; i >= 0; --i) trie_bytes = (trie_bytes << 8) | static_cast<unsigned char>(blob[i]);
  FLAME_CHECK(trie_bytes % 4 == 0 && trie_bytes <= blob.size() - 4, kOp, path, ": precompiled_charsmap declares a ",
              trie_bytes, "-byte trie in a ", blob.size(), "-byte map (corrupt model file)");
  m.units.resize(trie_bytes / 4);
  for (size_t i = 0; i < m.units.size(); ++i) {
    const auto* p = reinterpret_cast<const unsigned char*>(blob.data()) + 4 + 4 * i;
    m.units[i] = p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24);
  }
  m.replacements.assign(blob.substr(4 + trie_bytes));
  return m;
}

}  // namespace

struct T5Tokenizer::Impl {
  T5TokenizerOptions options;
  std::string path;
  CharsMap charsmap;
  std::unordered_map<std::string, int64_t> pieces;  // every piece of the model -> id
  std::vector<double> scores;                      // by id
  std::vector<std::pair<std::string, int64_t>> added;
  size_t max_piece_bytes = 0;
  int64_t n_pieces = 0, eos = 0, pad = 0, unk = 0;
  double unk_score = 0;

  // Step 4 of Note [T5 tokenization] for one piece ("▁" + word part).
  void viterbi(std::string_view s, std::vector<int64_t>& out) const {
    const size_t n = s.size();
    struct Node {
      double score = 0;
      size_t start = 0;
      int64_t id = -1;  // -1: not reached
    };
    std::vector<Node> best(n + 1);
    best[0].id = 0;
    size_t pos = 0;
    while (pos < n) {
      const size_t char_len = static_cast<size_t>(utf8proc_utf8class[static_cast<unsigned char>(s[pos])]);
      const size_t step = char_len == 0 ? 1 : std::min(char_len, n - pos);
      const double here = best[pos].score;
      bool single = false;
      const size_t limit = std::min(max_piece_bytes, n - pos);
      for (size_t len = 1; len <= limit; ++len) {
        auto it = pieces.find(std::string(s.substr(pos, len)));
        if (it == pieces.end()) continue;
        const double cand = here + scores[static_cast<size_t>(it->second)];
        Node& t = best[pos + len];
        if (t.id < 0 || cand > t.score) t = {cand, pos, it->second};
        if (len == step) single = true;
      }
      if (!single) {
        const double cand = here + unk_score;
        Node& t = best[pos + step];
        if (t.id < 0 || cand > t.score) t = {cand, pos, unk};
      }
      pos += step;
    }
    std::vector<int64_t> rev;
    bool last_unk = false;
    for (size_t end = n; end > 0; end = best[end].start) {
      const int64_t id = best[end].id;
      if (id == unk && last_unk) continue;  // consecutive unknowns are one <unk>
      rev.push_back(id);
      last_unk = id == unk;
    }
    out.insert(out.end(), rev.rbegin(), rev.rend());
  }
};

T5Tokenizer T5Tokenizer::from_file(const std::string& spiece_model, const T5TokenizerOptions& options) {
  FLAME_CHECK(std::filesystem::is_regular_file(spiece_model), kOp, spiece_model, " does not exist or is not a file");
  FLAME_CHECK(options.max_length >= 1, kOp, "max_length must be at least 1 (for \"</s>\"), got ", options.max_length);
  FLAME_CHECK(options.extra_ids >= 0, kOp, "extra_ids must be >= 0, got ", options.extra_ids);
  sentencepiece::SentencePieceProcessor sp;
  const auto status = sp.Load(spiece_model);
  FLAME_CHECK(status.ok(), kOp, spiece_model, " is not a SentencePiece model: ", status.ToString());
  auto impl = std::make_shared<Impl>();
  impl->options = options;
  impl->path = spiece_model;
  impl->n_pieces = sp.GetPieceSize();
  impl->scores.resize(static_cast<size_t>(impl->n_pieces));
  double min_score = std::numeric_limits<double>::infinity();
  for (int i = 0; i < sp.GetPieceSize(); ++i) {
    const std::string& p = sp.IdToPiece(i);
    impl->pieces.emplace(p, i);
    impl->scores[static_cast<size_t>(i)] = static_cast<double>(sp.GetScore(i));
    impl->max_piece_bytes = std::max(impl->max_piece_bytes, p.size());
    min_score = std::min(min_score, impl->scores[static_cast<size_t>(i)]);
  }
  impl->unk_score = min_score - kUnkPenalty;
  auto id_of = [&](const char* t) {
    auto it = impl->pieces.find(t);
    FLAME_CHECK(it != impl->pieces.end(), kOp, spiece_model, " has no \"", t, "\" piece: not a T5 vocabulary");
    return it->second;
  };
  impl->pad = id_of("<pad>");
  impl->eos = id_of("</s>");
  impl->unk = id_of("<unk>");
  impl->added = {{"<pad>", impl->pad}, {"</s>", impl->eos}, {"<unk>", impl->unk}};
  for (int64_t i = 0; i < options.extra_ids; ++i) {
    impl->added.emplace_back("<extra_id_" + std::to_string(i) + ">", impl->n_pieces + options.extra_ids - 1 - i);
  }
  bool ok = true;
  const std::string proto = sp.serialized_model_proto();
  std::optional<std::string_view> spec = find_bytes_field(proto, 3, ok);  // ModelProto.normalizer_spec
  std::optional<std::string_view> map;
  if (ok && spec) map = find_bytes_field(*spec, 2, ok);  // NormalizerSpec.precompiled_charsmap
  FLAME_CHECK(ok, kOp, spiece_model, ": the normalizer spec of the model cannot be parsed (corrupt model file)");
  if (map) impl->charsmap = read_charsmap(*map, spiece_model);
  T5Tokenizer t;
  t.impl_ = std::move(impl);
  return t;
}

T5Tokenizer T5Tokenizer::from_folder(const std::string& dir, const T5TokenizerOptions& options) {
  const std::filesystem::path p = std::filesystem::path(dir) / "spiece.model";
  FLAME_CHECK(std::filesystem::is_regular_file(p), kOp, dir,
              " has no spiece.model (expected a T5 tokenizer folder such as SD3's tokenizer_3/ or FLUX's tokenizer_2/)");
  return from_file(p.string(), options);
}

std::string T5Tokenizer::normalize(std::string_view text) const {
  const std::u32string cps = utf8_decode(text, kOp);
  if (impl_->charsmap.empty()) return std::string(text);
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  utf8proc_int32_t state = 0;
  while (i < cps.size()) {
    size_t j = i + 1;  // the extended grapheme cluster [i, j)
    while (j < cps.size() && !utf8proc_grapheme_break_stateful(static_cast<utf8proc_int32_t>(cps[j - 1]),
                                                                static_cast<utf8proc_int32_t>(cps[j]), &state)) {
      ++j;
    }
    std::string cluster;
    for (size_t k = i; k < j; ++k) cluster += utf8_encode(cps[k]);
    std::optional<std::string_view> whole;
    if (cluster.size() < 6) whole = impl_->charsmap.shortest_prefix(cluster);
    if (whole) {
      out += *whole;
    } else {
      for (size_t k = i; k < j; ++k) {
        const std::string c = utf8_encode(cps[k]);
        std::optional<std::string_view> r = impl_->charsmap.shortest_prefix(c);
        out += r ? std::string(*r) : c;
      }
    }
    i = j;
  }
  return out;
}

std::vector<int64_t> T5Tokenizer::encode(std::string_view text) const {
  std::vector<int64_t> ids;
  for (const TextSegment& seg : split_special_tokens(text, impl_->added)) {
    if (seg.special_id >= 0) {
      ids.push_back(seg.special_id);
      continue;
    }
    const std::u32string cps = utf8_decode(normalize(seg.text), kOp);
    std::string word;
    auto flush = [&] {
      if (word.empty()) return;
      if (word.rfind(kMeta, 0) != 0) word.insert(0, kMeta);
      // Each "▁" starts a piece.
      size_t start = 0;
      for (size_t at = word.find(kMeta, 3); at != std::string::npos; at = word.find(kMeta, at + 3)) {
        impl_->viterbi(std::string_view(word).substr(start, at - start), ids);
        start = at;
      }
      impl_->viterbi(std::string_view(word).substr(start), ids);
      word.clear();
    };
    for (char32_t c : cps) {
      if (is_white_space(c)) {
        flush();
      } else {
        word += utf8_encode(c);
      }
    }
    flush();
  }
  ids.push_back(impl_->eos);
  return ids;
}

TokenIds T5Tokenizer::encode_padded(std::string_view text) const {
  return truncate_and_pad(encode(text), static_cast<size_t>(impl_->options.max_length), impl_->eos, impl_->pad);
}

TokenBatch T5Tokenizer::operator()(const std::vector<std::string>& texts) const {
  return encode_batch(texts, [this](const std::string& t) { return encode_padded(t); });
}

int64_t T5Tokenizer::eos_id() const { return impl_->eos; }
int64_t T5Tokenizer::pad_id() const { return impl_->pad; }
int64_t T5Tokenizer::unk_id() const { return impl_->unk; }
int64_t T5Tokenizer::vocab_size() const { return impl_->n_pieces + impl_->options.extra_ids; }
const T5TokenizerOptions& T5Tokenizer::options() const { return impl_->options; }
int64_t T5Tokenizer::token_to_id(const std::string& token) const {
  auto it = impl_->pieces.find(token);
  if (it != impl_->pieces.end()) return it->second;
  for (const auto& [t, id] : impl_->added) {
    if (t == token) return id;
  }
  return -1;
}

}  // namespace flame_diffusion::models
