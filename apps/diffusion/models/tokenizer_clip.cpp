#include "models/tokenizer_clip.h"

#include <zlib.h>

#include <algorithm>
#include <climits>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>
#include <re2/re2.h>
#include <utf8proc.h>

#include "models/tokenizer_util.h"

namespace flame_diffusion::models {
namespace {

namespace fs = std::filesystem;
constexpr const char* kOp = "ClipTokenizer";
constexpr const char* kBos = "<|startoftext|>";
constexpr const char* kEos = "<|endoftext|>";
// open_clip reads this many merges after the header line of bpe_simple_vocab_16e6.txt.gz.
constexpr size_t kOpenClipMerges = 49152 - 256 - 2;

// GPT-2's byte-to-unicode table: printable Latin-1 bytes ('!'..'~', U+00A1..U+00AC,
// U+00AE..U+00FF) stand for themselves, the other 68 bytes for U+0100 + n in byte order.
// Returns the code point of each byte, and (second) the order of the 256 symbols in the vocabulary.
std::pair<std::vector<char32_t>, std::vector<int>> byte_table() {
  std::vector<char32_t> cp(256, 0);
  std::vector<int> order;
  auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); };
  for (int b = 0; b < 256; ++b) {
    if (printable(b)) {
      cp[b] = static_cast<char32_t>(b);
      order.push_back(b);
    }
  }
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    if (!printable(b)) {
      cp[b] = static_cast<char32_t>(256 + n++);
      order.push_back(b);
    }
  }
  return {cp, order};
}

std::string merge_key(const std::string& a, const std::string& b) { return a + ' ' + b; }

}  // namespace

struct ClipTokenizer::Impl {
  ClipTokenizerOptions options;
  std::string origin;  // the files, for messages
  std::unordered_map<std::string, int64_t> vocab;
  std::unordered_map<std::string, int> ranks;  // "a b" -> merge rank
  std::vector<std::string> byte_symbol;         // byte -> its UTF-8 symbol
  int64_t bos = 0, eos = 0, pad = 0;
  std::vector<std::pair<std::string, int64_t>> specials;  // text -> id, cut from raw text
  std::unique_ptr<RE2> pattern;

  void finish() {
    auto [cp, order] = byte_table();
    byte_symbol.resize(256);
    for (int b = 0; b < 256; ++b) byte_symbol[b] = utf8_encode(cp[b]);
    auto id_of = [&](const char* t) {
      auto it = vocab.find(t);
      FLAME_CHECK(it != vocab.end(), kOp, origin, " has no \"", t, "\" token: not a CLIP vocabulary");
      return it->second;
    };
    bos = id_of(kBos);
    eos = id_of(kEos);
    pad = options.pad_id.value_or(eos);
    FLAME_CHECK(pad >= 0 && pad < static_cast<int64_t>(vocab.size()), kOp, "pad_id ", pad,
                " is outside the vocabulary of ", vocab.size(), " ids (", origin, ")");
    FLAME_CHECK(options.max_length >= 2, kOp, "max_length must be at least 2 (BOS and EOS), got ", options.max_length);
    specials = {{kBos, bos}, {kEos, eos}};
    if (options.pad_token_in_text && pad != eos) {
      for (const auto& [tok, id] : vocab) {
        if (id == pad) specials.emplace_back(tok, pad);
      }
    }
    RE2::Options ro;
    ro.set_encoding(RE2::Options::EncodingUTF8);
    pattern = std::make_unique<RE2>(R"(('s|'t|'re|'ve|'m|'ll|'d|\p{L}+|\p{N}|[^\s\p{L}\p{N}]+))", ro);
    FLAME_CHECK(pattern->ok(), kOp, "the pre-tokenisation regex does not compile: ", pattern->error());
  }

  // Step 4 of Note [CLIP tokenization] for one piece.
  void bpe(const std::string& piece, std::vector<int64_t>& out) const {
    std::vector<std::string> word;
    word.reserve(piece.size());
    for (unsigned char b : piece) word.push_back(byte_symbol[b]);
    if (word.empty()) return;
    word.back() += "</w>";
    while (word.size() > 1) {
      int best = INT_MAX;
      std::string best_a, best_b;
      for (size_t i = 0; i + 1 < word.size(); ++i) {
        auto it = ranks.find(merge_key(word[i], word[i + 1]));
        if (it != ranks.end() && it->second < best) {
          best = it->second;
          best_a = word[i];
          best_b = word[i + 1];
        }
      }
      if (best == INT_MAX) break;
      std::vector<std::string> merged;
      merged.reserve(word.size());
      for (size_t i = 0; i < word.size();) {
        if (i + 1 < word.size() && word[i] == best_a && word[i + 1] == best_b) {
          merged.push_back(best_a + best_b);
          i += 2;
        } else {
          merged.push_back(word[i]);
          i += 1;
        }
      }
      word = std::move(merged);
    }
    for (const std::string& s : word) {
      auto it = vocab.find(s);
      out.push_back(it == vocab.end() ? eos : it->second);  // unk_token is "<|endoftext|>"
    }
  }
};

namespace {

std::shared_ptr<ClipTokenizer::Impl> read_merges(std::istream& in, const std::string& origin, size_t limit,
                                                 std::vector<std::pair<std::string, std::string>>& merges) {
  auto impl = std::make_shared<ClipTokenizer::Impl>();
  impl->origin = origin;
  std::string line;
  size_t line_no = 0;
  while (std::getline(in, line) && merges.size() < limit) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line_no == 1 && line.rfind("#version", 0) == 0) continue;
    if (line.empty()) continue;
    std::istringstream ls(line);
    std::string a, b, extra;
    ls >> a >> b;
    FLAME_CHECK(!a.empty() && !b.empty() && !(ls >> extra), kOp, origin, " line ", line_no,
                ": a merge must be two symbols separated by a space, found \"", line, "\"");
    impl->ranks.emplace(merge_key(a, b), static_cast<int>(merges.size()));
    merges.emplace_back(a, b);
  }
  FLAME_CHECK(!merges.empty(), kOp, origin, " holds no merges");
  return impl;
}

std::string gunzip_file(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  FLAME_CHECK(f != nullptr, kOp, "cannot open ", path);
  std::string out;
  char buf[1 << 16];
  int n = 0;
  while ((n = gzread(f, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  int err = 0;
  const char* msg = gzerror(f, &err);
  std::string what = (n < 0 || err < 0) ? std::string(msg ? msg : "read error") : "";
  gzclose(f);
  FLAME_CHECK(what.empty(), kOp, path, " is not a readable gzip file (", what,
              "): expected open_clip's bpe_simple_vocab_16e6.txt.gz");
  return out;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  FLAME_CHECK(in.good(), kOp, "cannot open ", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// pad_token of a transformers tokenizer folder: a string or {"content": ...}; "" when absent.
std::string folder_pad_token(const fs::path& dir) {
  for (const char* name : {"special_tokens_map.json", "tokenizer_config.json"}) {
    fs::path p = dir / name;
    if (!fs::is_regular_file(p)) continue;
    nlohmann::json j = nlohmann::json::parse(read_file(p.string()), nullptr, false);
    FLAME_CHECK(!j.is_discarded() && j.is_object(), kOp, p.string(), " is not a JSON object");
    if (!j.contains("pad_token")) continue;
    const auto& v = j["pad_token"];
    if (v.is_string()) return v.get<std::string>();
    if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  }
  return "";
}

}  // namespace

ClipTokenizer ClipTokenizer::from_files(const std::string& vocab_json, const std::string& merges_txt,
                                        const ClipTokenizerOptions& options) {
  std::ifstream min(merges_txt);
  FLAME_CHECK(min.good(), kOp, "cannot open merges file ", merges_txt);
  std::vector<std::pair<std::string, std::string>> merges;
  auto impl = read_merges(min, merges_txt, SIZE_MAX, merges);
  impl->origin = vocab_json + " + " + merges_txt;
  impl->options = options;
  nlohmann::json j = nlohmann::json::parse(read_file(vocab_json), nullptr, false);
  FLAME_CHECK(!j.is_discarded() && j.is_object(), kOp, vocab_json, " is not a JSON object of token -> id");
  for (auto it = j.begin(); it != j.end(); ++it) {
    FLAME_CHECK(it->is_number_integer(), kOp, vocab_json, ": the id of \"", it.key(), "\" is not an integer");
    impl->vocab.emplace(it.key(), it->get<int64_t>());
  }
  // The ids index the text encoder's embedding table: each must lie in [0, vocabulary size).
  const auto n = static_cast<int64_t>(impl->vocab.size());
  for (const auto& [tok, id] : impl->vocab) {
    FLAME_CHECK(id >= 0 && id < n, kOp, vocab_json, ": the id of \"", tok, "\" is ", id, ", outside [0, ", n,
                ") of its ", n, " tokens: not a CLIP vocabulary (or a damaged one)");
  }
  impl->finish();
  ClipTokenizer t;
  t.impl_ = std::move(impl);
  return t;
}

ClipTokenizer ClipTokenizer::from_folder(const std::string& dir, ClipTokenizerOptions options) {
  fs::path d(dir);
  FLAME_CHECK(fs::is_regular_file(d / "vocab.json") && fs::is_regular_file(d / "merges.txt"), kOp, dir,
              " has no vocab.json + merges.txt (expected a transformers tokenizer folder such as a pipeline's "
              "tokenizer/ or tokenizer_2/)");
  if (!options.pad_id) {
    std::string pad = folder_pad_token(d);
    if (!pad.empty()) {
      ClipTokenizer probe = from_files((d / "vocab.json").string(), (d / "merges.txt").string(), options);
      int64_t id = probe.token_to_id(pad);
      FLAME_CHECK(id >= 0, kOp, dir, ": pad_token \"", pad, "\" is not in vocab.json");
      if (id == probe.eos_id()) return probe;
      options.pad_id = id;
    }
  }
  return from_files((d / "vocab.json").string(), (d / "merges.txt").string(), options);
}

ClipTokenizer ClipTokenizer::from_bpe_gz(const std::string& path, const ClipTokenizerOptions& options) {
  std::istringstream in(gunzip_file(path));
  std::vector<std::pair<std::string, std::string>> merges;
  std::string header;
  std::getline(in, header);  // open_clip skips the first line whatever it holds
  auto impl = read_merges(in, path, kOpenClipMerges, merges);
  FLAME_CHECK(merges.size() == kOpenClipMerges, kOp, path, " holds ", merges.size(), " merges, open_clip reads ",
              kOpenClipMerges, ": not bpe_simple_vocab_16e6.txt.gz");
  impl->options = options;
  auto [cp, order] = byte_table();
  int64_t id = 0;
  for (int b : order) impl->vocab.emplace(utf8_encode(cp[b]), id++);
  for (int b : order) impl->vocab.emplace(utf8_encode(cp[b]) + "</w>", id++);
  for (const auto& [a, b] : merges) impl->vocab.emplace(a + b, id++);
  impl->vocab.emplace(kBos, id++);
  impl->vocab.emplace(kEos, id++);
  impl->finish();
  ClipTokenizer t;
  t.impl_ = std::move(impl);
  return t;
}

std::string ClipTokenizer::normalize(std::string_view text) {
  std::u32string cps = utf8_decode_nfc(text, kOp);
  std::string out;
  out.reserve(text.size());
  bool in_space = false;
  for (char32_t c : cps) {
    if (is_white_space(c)) {
      if (!in_space) out += ' ';
      in_space = true;
      continue;
    }
    in_space = false;
    if (c == 0x130) {  // the one code point whose full lower-case mapping has two: "i" + U+0307
      out += "i\xcc\x87";
      continue;
    }
    out += utf8_encode(static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))));
  }
  return out;
}

std::vector<std::string> ClipTokenizer::pre_tokenize(std::string_view normalized) const {
  std::vector<std::string> pieces;
  re2::StringPiece input(normalized.data(), normalized.size());
  std::string piece;
  while (RE2::FindAndConsume(&input, *impl_->pattern, &piece)) {
    if (piece.empty()) break;  // the pattern has no empty match; guard against a stall anyway
    pieces.push_back(piece);
  }
  return pieces;
}

std::vector<int64_t> ClipTokenizer::encode(std::string_view text) const {
  std::vector<int64_t> ids{impl_->bos};
  for (const TextSegment& seg : split_special_tokens(text, impl_->specials)) {
    if (seg.special_id >= 0) {
      ids.push_back(seg.special_id);
      continue;
    }
    for (const std::string& piece : pre_tokenize(normalize(seg.text))) impl_->bpe(piece, ids);
  }
  ids.push_back(impl_->eos);
  return ids;
}

TokenIds ClipTokenizer::encode_padded(std::string_view text) const {
  return truncate_and_pad(encode(text), static_cast<size_t>(impl_->options.max_length), impl_->eos, impl_->pad);
}

TokenBatch ClipTokenizer::operator()(const std::vector<std::string>& texts) const {
  return encode_batch(texts, [this](const std::string& t) { return encode_padded(t); });
}

int64_t ClipTokenizer::bos_id() const { return impl_->bos; }
int64_t ClipTokenizer::eos_id() const { return impl_->eos; }
int64_t ClipTokenizer::pad_id() const { return impl_->pad; }
int64_t ClipTokenizer::vocab_size() const { return static_cast<int64_t>(impl_->vocab.size()); }
const ClipTokenizerOptions& ClipTokenizer::options() const { return impl_->options; }
int64_t ClipTokenizer::token_to_id(const std::string& token) const {
  auto it = impl_->vocab.find(token);
  return it == impl_->vocab.end() ? -1 : it->second;
}

}  // namespace flame_diffusion::models
