// The CLIP and T5 tokenizers against ids of transformers' CLIPTokenizer / T5TokenizerFast, stored in
// tests/data/tokenizers by apps/diffusion/reference/tokenizers_ref.py: 1,200 generated captions
// (Unicode, accents, CJK, emoji, punctuation, numbers, very long, empty, runs of whitespace). CLIP
// runs on open_clip's shipped vocabulary (bpe_simple_vocab_16e6.txt.gz, committed: MIT, see
// LICENSE-open_clip.txt there), T5 on a unigram SentencePiece model trained by the same script.
#include <gtest/gtest.h>

#include <zlib.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "model_test_util.h"
#include "models/checkpoint.h"
#include "models/tokenizer_clip.h"
#include "models/tokenizer_t5.h"
#include "models/tokenizer_util.h"

namespace {

namespace fs = std::filesystem;
using flame_diffusion::models::ClipTokenizer;
using flame_diffusion::models::ClipTokenizerOptions;
using flame_diffusion::models::JsonConfig;
using flame_diffusion::models::T5Tokenizer;
using flame_diffusion::models::T5TokenizerOptions;
using flame_diffusion::models::TokenIds;

// FLAME_TOKENIZER_DATA points the suites at another corpus written by the script (e.g. its
// --unicode-sweep over every code point).
fs::path data_dir() {
  const char* e = std::getenv("FLAME_TOKENIZER_DATA");
  return e && *e ? fs::path(e) : fs::path(__FILE__).parent_path() / "data" / "tokenizers";
}

std::vector<std::string> read_lines(const fs::path& p) {
  std::ifstream in(p);
  EXPECT_TRUE(in.good()) << "cannot open " << p << " (apps/diffusion/reference/tokenizers_ref.py writes it)";
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// captions.jsonl: one JSON string a line.
const std::vector<std::string>& captions() {
  static const std::vector<std::string> caps = [] {
    std::vector<std::string> out;
    for (const std::string& line : read_lines(data_dir() / "captions.jsonl")) {
      out.push_back(JsonConfig::parse("{\"t\": " + line + "}", "captions.jsonl").get_string("t"));
    }
    return out;
  }();
  return caps;
}

std::vector<int64_t> parse_ids(const std::string& s) {
  std::vector<int64_t> ids;
  if (s == "-") return ids;
  std::istringstream in(s);
  for (int64_t v; in >> v;) ids.push_back(v);
  return ids;
}

std::vector<std::vector<int64_t>> read_id_lines(const std::string& name) {
  std::vector<std::vector<int64_t>> out;
  for (const std::string& line : read_lines(data_dir() / name)) out.push_back(parse_ids(line));
  return out;
}

// "a|b|c" -> id lists.
std::vector<std::vector<int64_t>> split_fields(const std::string& line) {
  std::vector<std::vector<int64_t>> out;
  std::istringstream in(line);
  for (std::string f; std::getline(in, f, '|');) out.push_back(parse_ids(f));
  return out;
}

std::string show(const std::vector<int64_t>& ids) {
  std::ostringstream s;
  for (size_t i = 0; i < ids.size(); ++i) s << (i ? " " : "") << ids[i];
  return s.str();
}

// The caption, with control characters escaped, for failure messages.
std::string quoted(const std::string& text) {
  std::ostringstream s;
  s << '"';
  for (unsigned char c : text) {
    if (c < 0x20 || c == 0x7f) {
      s << "\\x" << std::hex << static_cast<int>(c) << std::dec;
    } else {
      s << c;
    }
  }
  return s.str() + '"';
}

// Compares every caption's ids; reports the first differing caption with both id lists.
template <class Encode>
void expect_all_equal(const std::vector<std::vector<int64_t>>& expected, Encode&& encode, const char* what) {
  const auto& caps = captions();
  ASSERT_EQ(expected.size(), caps.size()) << what << ": id file and captions.jsonl differ in length";
  ASSERT_GE(caps.size(), 1000u);
  size_t differ = 0;
  std::ostringstream which;
  for (size_t i = 0; i < caps.size(); ++i) {
    std::vector<int64_t> got = encode(caps[i]);
    if (got != expected[i]) {
      if (differ == 0) {
        ADD_FAILURE() << what << ": caption " << i << " " << quoted(caps[i]) << "\n  expected " << show(expected[i])
                      << "\n  got      " << show(got);
      }
      if (differ < 200) which << ' ' << i;
      ++differ;
    }
  }
  EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << caps.size() << " captions differ:" << which.str()
                        << (differ > 200 ? " ..." : "");
}

const ClipTokenizer& clip_from_gz() {
  static const ClipTokenizer t = ClipTokenizer::from_bpe_gz((data_dir() / "bpe_simple_vocab_16e6.txt.gz").string());
  return t;
}

// The merges of the .gz as lines (header line first).
std::vector<std::string> gz_lines(const fs::path& p) {
  gzFile f = gzopen(p.string().c_str(), "rb");
  EXPECT_NE(f, nullptr);
  std::string all;
  char buf[1 << 16];
  for (int n; (n = gzread(f, buf, sizeof(buf))) > 0;) all.append(buf, static_cast<size_t>(n));
  gzclose(f);
  std::vector<std::string> lines;
  std::istringstream in(all);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// ---- CLIP ----

TEST(TokenizerClip, OpenClipVocabularyLayout) {
  const ClipTokenizer& t = clip_from_gz();
  EXPECT_EQ(t.vocab_size(), 49408);
  EXPECT_EQ(t.bos_id(), 49406);
  EXPECT_EQ(t.eos_id(), 49407);
  EXPECT_EQ(t.pad_id(), 49407);
  EXPECT_EQ(t.token_to_id("!"), 0);      // the first printable byte
  EXPECT_EQ(t.token_to_id("!</w>"), 256);
  EXPECT_EQ(t.token_to_id("\xc4\x80"), 188);  // byte 0x00 spelled U+0100, after the 188 printable ones
  EXPECT_EQ(t.token_to_id("<|startoftext|>"), 49406);
  // The first merge of the file is id 512.
  std::vector<std::string> lines = gz_lines(data_dir() / "bpe_simple_vocab_16e6.txt.gz");
  ASSERT_GT(lines.size(), 2u);
  std::istringstream first(lines[1]);
  std::string a, b;
  first >> a >> b;
  EXPECT_EQ(t.token_to_id(a + b), 512);
}

TEST(TokenizerClip, KnownCaption) {
  // "a photo of a cat": common words are single tokens ("a</w>" 320, "photo</w>" 1125, "of</w>"
  // 539, "cat</w>" 2368 in CLIP's vocabulary, as published in every CLIP-L tokenizer folder).
  EXPECT_EQ(clip_from_gz().encode("a photo of a cat"),
            (std::vector<int64_t>{49406, 320, 1125, 539, 320, 2368, 49407}));
  EXPECT_EQ(clip_from_gz().encode(""), (std::vector<int64_t>{49406, 49407}));
}

TEST(TokenizerClip, NormalizeAndPreTokenize) {
  EXPECT_EQ(ClipTokenizer::normalize("  A\t\n B\xe3\x80\x80" "C  "), " a b c ");
  EXPECT_EQ(ClipTokenizer::normalize("\xc4\xb0"), "i\xcc\x87");           // U+0130, full lower-case mapping
  EXPECT_EQ(ClipTokenizer::normalize("e\xcc\x81"), "\xc3\xa9");            // NFC
  EXPECT_EQ(clip_from_gz().pre_tokenize("it's 42!? x"),
            (std::vector<std::string>{"it", "'s", "4", "2", "!?", "x"}));
  std::string msg = fd_test::error_of([] { clip_from_gz().encode("bad \xff byte"); });
  EXPECT_NE(msg.find("not valid UTF-8 at byte 4"), std::string::npos) << msg;
}

TEST(TokenizerClip, IdentityWithTransformersOnCaptions) {
  expect_all_equal(read_id_lines("clip_ids.txt"), [](const std::string& c) { return clip_from_gz().encode(c); },
                   "CLIP (open_clip vocabulary) vs transformers CLIPTokenizer");
}

TEST(TokenizerClip, PaddingTruncationAndBigG) {
  ClipTokenizerOptions g_opts;
  g_opts.pad_id = 0;
  ClipTokenizerOptions ghf_opts = g_opts;
  ghf_opts.pad_token_in_text = true;
  const fs::path gz = data_dir() / "bpe_simple_vocab_16e6.txt.gz";
  ClipTokenizer g = ClipTokenizer::from_bpe_gz(gz.string(), g_opts);
  ClipTokenizer ghf = ClipTokenizer::from_bpe_gz(gz.string(), ghf_opts);
  const auto& caps = captions();
  std::vector<std::string> lines = read_lines(data_dir() / "clip_padded.txt");
  ASSERT_EQ(lines.size(), (caps.size() + 9) / 10);
  size_t truncated = 0;
  for (size_t k = 0; k < lines.size(); ++k) {
    const std::string& c = caps[k * 10];
    auto f = split_fields(lines[k]);
    ASSERT_EQ(f.size(), 6u);
    TokenIds l = clip_from_gz().encode_padded(c), og = g.encode_padded(c), hf = ghf.encode_padded(c);
    EXPECT_EQ(l.ids, f[0]) << "CLIP-L ids of " << quoted(c);
    EXPECT_EQ(l.mask, f[1]) << "CLIP-L mask of " << quoted(c);
    EXPECT_EQ(og.ids, f[2]) << "bigG (open_clip) ids of " << quoted(c);
    EXPECT_EQ(og.mask, f[3]) << "bigG (open_clip) mask of " << quoted(c);
    EXPECT_EQ(hf.ids, f[4]) << "bigG (transformers, pad_token \"!\") ids of " << quoted(c);
    EXPECT_EQ(hf.mask, f[5]) << "bigG (transformers, pad_token \"!\") mask of " << quoted(c);
    if (f[1].back() == 1) ++truncated;
  }
  EXPECT_GE(truncated, 5u) << "the corpus should hold captions longer than 77 tokens";

  // The batch form: [B, 77] int64.
  auto batch = clip_from_gz()({"a photo of a cat", ""});
  ASSERT_EQ(batch.input_ids.sizes(), (flame::Shape{2, 77}));
  EXPECT_EQ(batch.input_ids.dtype(), flame::DType::i64);
  EXPECT_EQ(batch.input_ids.to_vec<int64_t>()[77 + 1], 49407);
  EXPECT_EQ(batch.attention_mask.sum().item<int64_t>(), 7 + 2);
}

TEST(TokenizerClip, TransformersFilesLoadTheSame) {
  // vocab.json + merges.txt written from the .gz as the transformers layout has them, then loaded
  // through from_folder (with SDXL tokenizer_2's pad_token "!").
  const fs::path dir = fd_test::fresh_temp_dir("clip_tok", "folder");
  std::vector<std::string> lines = gz_lines(data_dir() / "bpe_simple_vocab_16e6.txt.gz");
  const ClipTokenizer& ref = clip_from_gz();
  {
    std::ofstream merges(dir / "merges.txt");
    merges << "#version: 0.2\n";
    for (size_t i = 1; i <= 48894; ++i) merges << lines[i] << "\n";
  }
  // vocab.json from the reference's own ids: every byte symbol, its "</w>" form, every merge result.
  std::map<int64_t, std::string> by_id;
  for (size_t i = 1; i <= 48894; ++i) {
    std::istringstream s(lines[i]);
    std::string a, b;
    s >> a >> b;
    by_id[ref.token_to_id(a + b)] = a + b;
  }
  for (int cp = 0; cp < 0x200; ++cp) {
    std::string sym = flame_diffusion::models::utf8_encode(static_cast<char32_t>(cp));
    for (const std::string& t : {sym, sym + "</w>"}) {
      int64_t id = ref.token_to_id(t);
      if (id >= 0) by_id[id] = t;
    }
  }
  by_id[49406] = "<|startoftext|>";
  by_id[49407] = "<|endoftext|>";
  ASSERT_EQ(by_id.size(), 49408u);
  {
    std::ofstream vocab(dir / "vocab.json");
    vocab << "{";
    bool first = true;
    for (const auto& [id, tok] : by_id) {
      vocab << (first ? "" : ",") << "\"";
      for (char ch : tok) {
        if (ch == '"' || ch == '\\') vocab << '\\';
        vocab << ch;
      }
      vocab << "\":" << id;
      first = false;
    }
    vocab << "}";
  }
  fd_test::write_text(dir / "special_tokens_map.json", R"({"pad_token": {"content": "!", "lstrip": false}})");
  ClipTokenizer folder = ClipTokenizer::from_folder(dir.string());
  EXPECT_EQ(folder.pad_id(), 0);
  EXPECT_EQ(folder.vocab_size(), 49408);
  expect_all_equal(read_id_lines("clip_ids.txt"), [&](const std::string& c) { return folder.encode(c); },
                   "CLIP (vocab.json + merges.txt) vs transformers CLIPTokenizer");
  fs::remove_all(dir);
}

TEST(TokenizerClip, ErrorsNameTheFile) {
  std::string msg = fd_test::error_of([] { ClipTokenizer::from_folder("/nonexistent/tokenizer_2"); });
  EXPECT_NE(msg.find("/nonexistent/tokenizer_2 has no vocab.json + merges.txt"), std::string::npos) << msg;
  const fs::path dir = fd_test::fresh_temp_dir("clip_tok", "errors");
  fd_test::write_text(dir / "not.gz", "plain text\n");
  msg = fd_test::error_of([&] { ClipTokenizer::from_bpe_gz((dir / "not.gz").string()); });
  EXPECT_NE(msg.find("not.gz holds"), std::string::npos) << msg;
  fd_test::write_text(dir / "merges.txt", "#version: 0.2\na b c\n");
  fd_test::write_text(dir / "vocab.json", "{}");
  msg = fd_test::error_of([&] { ClipTokenizer::from_folder(dir.string()); });
  EXPECT_NE(msg.find("line 2: a merge must be two symbols"), std::string::npos) << msg;
  fs::remove_all(dir);
}

// ---- T5 ----

const T5Tokenizer& t5_test() {
  static const T5Tokenizer t = T5Tokenizer::from_file((data_dir() / "t5_test.model").string());
  return t;
}

TEST(TokenizerT5, SpecialIdsAndSentinels) {
  const T5Tokenizer& t = t5_test();
  EXPECT_EQ(t.pad_id(), 0);
  EXPECT_EQ(t.eos_id(), 1);
  EXPECT_EQ(t.unk_id(), 2);
  EXPECT_EQ(t.vocab_size(), 1000 + 100);  // 1000 trained pieces + 100 sentinels
  EXPECT_EQ(t.token_to_id("<extra_id_0>"), 1099);
  EXPECT_EQ(t.token_to_id("<extra_id_99>"), 1000);
  EXPECT_EQ(t.encode(""), (std::vector<int64_t>{1}));
  EXPECT_EQ(t.encode(" \t\n "), (std::vector<int64_t>{1}));
  EXPECT_EQ(t.encode("<extra_id_3></s><pad>"), (std::vector<int64_t>{1096, 1, 0, 1}));
  // Words never join across whitespace, and every word starts with "\u2581".
  std::vector<int64_t> ab = t.encode("cat dog");
  std::vector<int64_t> a = t.encode("cat"), b = t.encode("dog");
  a.pop_back();
  a.insert(a.end(), b.begin(), b.end());
  EXPECT_EQ(ab, a);
}

TEST(TokenizerT5, NormalizerIsTheModelsCharsMap) {
  // nmt_nfkc: full-width letters and digits fold, NBSP becomes a space, a decomposed accent composes.
  EXPECT_EQ(t5_test().normalize("\xef\xbc\xa1\xef\xbc\x91"), "A1");
  EXPECT_EQ(t5_test().normalize("a\xc2\xa0" "b"), "a b");
  EXPECT_EQ(t5_test().normalize("e\xcc\x81"), "\xc3\xa9");
}

TEST(TokenizerT5, IdentityWithTransformersOnCaptions) {
  expect_all_equal(read_id_lines("t5_ids.txt"), [](const std::string& c) { return t5_test().encode(c); },
                   "T5 vs transformers T5TokenizerFast");
}

TEST(TokenizerT5, PaddingAndTruncation) {
  T5TokenizerOptions o;
  o.max_length = 32;
  T5Tokenizer t = T5Tokenizer::from_file((data_dir() / "t5_test.model").string(), o);
  const auto& caps = captions();
  std::vector<std::string> lines = read_lines(data_dir() / "t5_padded.txt");
  ASSERT_EQ(lines.size(), (caps.size() + 9) / 10);
  size_t truncated = 0;
  for (size_t k = 0; k < lines.size(); ++k) {
    auto f = split_fields(lines[k]);
    ASSERT_EQ(f.size(), 2u);
    TokenIds got = t.encode_padded(caps[k * 10]);
    EXPECT_EQ(got.ids, f[0]) << "ids of " << quoted(caps[k * 10]);
    EXPECT_EQ(got.mask, f[1]) << "mask of " << quoted(caps[k * 10]);
    if (f[1].back() == 1) ++truncated;
  }
  EXPECT_GE(truncated, 5u);
  auto batch = t({"a cat", "", "a dog"});
  ASSERT_EQ(batch.input_ids.sizes(), (flame::Shape{3, 32}));
  EXPECT_EQ(batch.attention_mask.to_vec<int64_t>()[32], 1);  // "</s>" alone
  EXPECT_EQ(batch.attention_mask.to_vec<int64_t>()[33], 0);
}

TEST(TokenizerT5, ErrorsNameTheFile) {
  const fs::path dir = fd_test::fresh_temp_dir("t5_tok", "errors");
  std::string msg = fd_test::error_of([&] { T5Tokenizer::from_folder(dir.string()); });
  EXPECT_NE(msg.find("has no spiece.model"), std::string::npos) << msg;
  fd_test::write_text(dir / "spiece.model", "not a model");
  msg = fd_test::error_of([&] { T5Tokenizer::from_folder(dir.string()); });
  EXPECT_NE(msg.find("spiece.model is not a SentencePiece model"), std::string::npos) << msg;
  msg = fd_test::error_of([] { t5_test().encode("bad \xc3 byte"); });
  EXPECT_NE(msg.find("not valid UTF-8 at byte 4"), std::string::npos) << msg;
  fs::remove_all(dir);
}

}  // namespace
