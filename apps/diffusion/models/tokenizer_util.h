#pragma once
// Pieces the CLIP and T5 tokenizers share: UTF-8 through utf8proc, the cutting of special tokens
// out of raw text, padding and batching.
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "models/tokenizer_clip.h"

namespace flame_diffusion::models {

std::string utf8_encode(char32_t c);
// The code points of `text` after NFC (utf8proc). Raises flame::Error from `op` naming the byte
// offset when `text` is not valid UTF-8.
std::u32string utf8_decode_nfc(std::string_view text, const char* op);
// The code points of `text`, no normalisation (same error).
std::u32string utf8_decode(std::string_view text, const char* op);
// Unicode's White_Space property (Rust's char::is_whitespace, Oniguruma's \s): the Z categories
// (utf8proc) and U+0009..U+000D, U+0085.
bool is_white_space(char32_t c);

struct TextSegment {
  std::string_view text;   // plain text (special_id < 0)
  int64_t special_id = -1;  // a special token found in the text
};
// `text` cut at every occurrence of a special token's text (leftmost first, the longest of those
// starting at one position), as the tokenizers library extracts its added tokens before
// normalising. Empty plain segments are dropped.
std::vector<TextSegment> split_special_tokens(std::string_view text,
                                              const std::vector<std::pair<std::string, int64_t>>& specials);

// `ids` (at most `length` long) padded on the right with `pad`; mask 1 on ids, 0 on padding.
TokenIds pad_ids(std::vector<int64_t> ids, size_t length, int64_t pad);
// Truncates `ids` to `length` keeping `eos` last (as transformers' tokenizers truncate), then pads.
TokenIds truncate_and_pad(std::vector<int64_t> ids, size_t length, int64_t eos, int64_t pad);
// One padded row per text (`encode_padded(text)`), stacked into a batch.
template <class F>
TokenBatch encode_batch(const std::vector<std::string>& texts, F&& encode_padded) {
  std::vector<TokenIds> rows;
  rows.reserve(texts.size());
  for (const std::string& t : texts) rows.push_back(encode_padded(t));
  return stack_token_ids(rows);
}

}  // namespace flame_diffusion::models
