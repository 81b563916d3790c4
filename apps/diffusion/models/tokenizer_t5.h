#pragma once
// T5's SentencePiece (unigram) tokenizer, id for id as transformers' T5TokenizerFast, from the
// spiece.model users have (SD3's and FLUX's tokenizer_3/ / tokenizer_2/, any T5 v1.1 folder).
//
// Note [T5 tokenization]
// The model file is opened with libsentencepiece (Debian's libsentencepiece-dev): it validates the
// file and gives every piece with its score and kind. Encoding then follows T5TokenizerFast, which
// differs from SentencePiece's own Encode in ways that change ids:
//   1. added tokens are cut out of the raw text first: "<pad>", "</s>", "<unk>" and the sentinels
//      "<extra_id_0>".."<extra_id_{N-1}>" (N = extra_ids, 100 for T5), numbered down from the end:
//      "<extra_id_i>" = piece count + N - 1 - i. SentencePiece reads them as plain characters;
//   2. the model's normaliser (precompiled_charsmap, nmt_nfkc for T5) is applied per extended
//      grapheme cluster (utf8proc): a cluster shorter than 6 bytes is replaced as a whole by the
//      mapping of the SHORTEST key of the map that prefixes it; otherwise each code point is mapped
//      on its own. SentencePiece uses the longest key at each position instead;
//   3. the text is split at White_Space (words never join), every word gets "▁" in front unless it
//      starts with one, and each "▁" begins a new piece (SentencePiece also collapses whitespace,
//      but lets characters the map turns into nothing join words);
//   4. each piece is segmented by Viterbi over the pieces' log-probabilities in double precision:
//      for ties the path whose last piece starts earliest wins (SentencePiece keeps float scores and
//      breaks ties otherwise, so long repeats such as "!!!!!!" differ); a character no piece covers
//      costs min score - 10 and consecutive unknowns become one <unk>;
//   5. "</s>" (id 1) is appended; with truncation, the first max_length - 1 tokens are kept; padding
//      with "<pad>" (0) on the right, mask 0 there.
// On the test corpus SentencePiece's own Encode gives other ids than T5TokenizerFast for 327 of the
// 1,200 captions; this tokenizer matches the fast one on all of them and on every code point of the
// reference script's --unicode-sweep. The pipeline is the one transformers builds from spiece.model;
// a folder's tokenizer.json, when transformers loads that instead, is not read here.
// The map (a darts-clone double array followed by the replacement strings) is read from the model's
// normalizer_spec.precompiled_charsmap. A model without one is not normalised (as transformers).
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "models/tokenizer_clip.h"

namespace flame_diffusion::models {

struct T5TokenizerOptions {
  int64_t max_length = 512;  // T5's model_max_length; SD3 uses 256 (or 77), FLUX 512 (dev) / 256 (schnell)
  int64_t extra_ids = 100;   // the "<extra_id_i>" sentinels transformers adds after the pieces
};

class T5Tokenizer {
 public:
  // A SentencePiece model file (spiece.model). Raises flame::Error naming the file when it does not
  // load or lacks "<pad>", "</s>" or "<unk>".
  static T5Tokenizer from_file(const std::string& spiece_model, const T5TokenizerOptions& options = {});
  // A tokenizer folder holding spiece.model (a pipeline's tokenizer_3/ or tokenizer_2/).
  static T5Tokenizer from_folder(const std::string& dir, const T5TokenizerOptions& options = {});

  // The ids of `text` followed by "</s>"; no truncation or padding.
  std::vector<int64_t> encode(std::string_view text) const;
  // Truncated to max_length ("</s>" kept last) and padded with "<pad>"; mask 1 on real tokens.
  TokenIds encode_padded(std::string_view text) const;
  TokenBatch operator()(const std::vector<std::string>& texts) const;
  // Step 2 of Note [T5 tokenization] (no added-token cutting). Raises for text that is not UTF-8.
  std::string normalize(std::string_view text) const;

  int64_t eos_id() const;
  int64_t pad_id() const;
  int64_t unk_id() const;
  // Pieces of the model plus the extra ids.
  int64_t vocab_size() const;
  const T5TokenizerOptions& options() const;
  // The id of a piece or sentinel ("▁cat", "<extra_id_0>"); -1 when absent.
  int64_t token_to_id(const std::string& token) const;

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

}  // namespace flame_diffusion::models
