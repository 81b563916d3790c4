#pragma once
// CLIP's byte-level BPE tokenizer, id for id as transformers' CLIPTokenizer (the tokenizers-backed
// one), for CLIP-L (SD 1.x, SDXL, SD3, FLUX) and OpenCLIP bigG (SDXL, SD3).
//
// Note [CLIP tokenization]
// The steps, as transformers' CLIPTokenizer runs them:
//   1. the special tokens "<|startoftext|>" and "<|endoftext|>" are cut out of the raw text (they
//      give their ids; ClipTokenizerOptions::pad_token_in_text adds the pad token's text);
//   2. each remaining segment is normalised: NFC, every run of White_Space becomes one " ", then
//      every code point is lower-cased on its own (full mapping: U+0130 becomes "i" U+0307);
//   3. pre-tokenisation with CLIP's regex (RE2, leftmost-first as Python's):
//        's|'t|'re|'ve|'m|'ll|'d|\p{L}+|\p{N}|[^\s\p{L}\p{N}]+
//      (whitespace between matches is dropped; CLIP's regex also lists the two special tokens, but
//      after step 1 a piece spelled like one, e.g. from "<|ENDOFTEXT|>", is split further by the
//      byte-level step exactly as this regex splits it);
//   4. each piece's UTF-8 bytes are spelled with GPT-2's byte-to-unicode table, "</w>" is appended
//      to the last symbol, and pairs are merged by merges.txt rank (lowest first, all occurrences
//      left to right) until no ranked pair is left;
//   5. BOS 49406 ... EOS 49407; with truncation to max_length the first max_length - 2 tokens are
//      kept and EOS is put last; padding goes on the right with the pad id, mask 0 there.
// Unicode data (NFC, categories, case) comes from utf8proc, the regex from RE2.
//
// Deviations, none of which the identity tests meet: open_clip's own SimpleTokenizer also runs
// ftfy.fix_text and html.unescape (twice) and strips, so "&amp;" or mojibake tokenise differently
// there; transformers' older slow CLIPTokenizer without ftfy used BERT's BasicTokenizer (control
// characters dropped, CJK ideographs split apart). Unicode versions: utf8proc 2.8 and RE2 classify
// by Unicode 15.0, the tokenizers library by 16.0: letters and digits assigned since (CJK Extension
// I, Garay, Kirat Rai, Egyptian Hieroglyphs Extended-A, ...) are not \p{L}/\p{N} here. The
// script's --unicode-sweep (every code point between two letters) finds exactly those: 119 of its
// 20,438 captions differ, each for such a code point; every other code point matches.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <flame/flame.h>

namespace flame_diffusion::models {

struct ClipTokenizerOptions {
  int64_t max_length = 77;
  // Padding id. nullopt: EOS (CLIP-L, transformers' pad_token "<|endoftext|>"); 0: OpenCLIP bigG
  // as open_clip pads (SDXL's tokenizer_2 declares pad_token "!", id 0).
  std::optional<int64_t> pad_id;
  // transformers' CLIPTokenizer treats the pad token's text as a special token inside captions as
  // well: with pad_token "!" every "!" of the text becomes id 0 (what diffusers' SDXL pipelines
  // feed the bigG encoder). Off (open_clip's reading, BPE over "!") unless set.
  bool pad_token_in_text = false;
};

// One caption's ids and mask, max_length long (padded) or unpadded.
struct TokenIds {
  std::vector<int64_t> ids;
  std::vector<int64_t> mask;
};

// A batch: input_ids and attention_mask, both [B, max_length] int64 on the CPU.
struct TokenBatch {
  flame::Tensor input_ids;
  flame::Tensor attention_mask;
};

class ClipTokenizer {
 public:
  // transformers layout: vocab.json (token -> id) and merges.txt ("#version" line, then "a b" lines).
  static ClipTokenizer from_files(const std::string& vocab_json, const std::string& merges_txt,
                                  const ClipTokenizerOptions& options = {});
  // A tokenizer folder of a pipeline (tokenizer/, tokenizer_2/): vocab.json + merges.txt. Its
  // special_tokens_map.json or tokenizer_config.json pad_token, when present and options.pad_id is
  // not set, picks the pad id ("!" -> 0 for SDXL's tokenizer_2).
  static ClipTokenizer from_folder(const std::string& dir, ClipTokenizerOptions options = {});
  // open_clip's bpe_simple_vocab_16e6.txt.gz: the first 48894 merges after the header line; the
  // vocabulary is the 256 byte symbols, the same with "</w>", the merged pairs in rank order, then
  // "<|startoftext|>" and "<|endoftext|>" (49408 ids).
  static ClipTokenizer from_bpe_gz(const std::string& path, const ClipTokenizerOptions& options = {});

  // BOS, the caption's tokens, EOS; no truncation or padding.
  std::vector<int64_t> encode(std::string_view text) const;
  // Truncated to max_length (EOS kept last) and padded with the pad id; mask 1 on real tokens.
  TokenIds encode_padded(std::string_view text) const;
  TokenBatch operator()(const std::vector<std::string>& texts) const;

  // The pieces of step 3 of Note [CLIP tokenization] for one segment (after normalisation).
  std::vector<std::string> pre_tokenize(std::string_view normalized) const;
  // Step 2 of Note [CLIP tokenization]. Raises flame::Error for text that is not valid UTF-8.
  static std::string normalize(std::string_view text);

  int64_t bos_id() const;
  int64_t eos_id() const;
  int64_t pad_id() const;
  int64_t vocab_size() const;
  const ClipTokenizerOptions& options() const;
  // The id of a vocabulary entry ("a</w>"); -1 when absent.
  int64_t token_to_id(const std::string& token) const;

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

// Stacks per-caption ids/masks (all of one length) into [B, L] int64 tensors.
TokenBatch stack_token_ids(const std::vector<TokenIds>& rows);

}  // namespace flame_diffusion::models
