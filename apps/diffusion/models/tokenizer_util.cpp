#include "models/tokenizer_util.h"

#include <cstdlib>
#include <memory>

#include <utf8proc.h>

namespace flame_diffusion::models {

std::string utf8_encode(char32_t c) {
  utf8proc_uint8_t buf[4];
  utf8proc_ssize_t n = utf8proc_encode_char(static_cast<utf8proc_int32_t>(c), buf);
  return std::string(reinterpret_cast<const char*>(buf), static_cast<size_t>(n));
}

std::u32string utf8_decode(std::string_view text, const char* op) {
  std::u32string out;
  out.reserve(text.size());
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(text.data());
  utf8proc_ssize_t left = static_cast<utf8proc_ssize_t>(text.size());
  size_t offset = 0;
  while (left > 0) {
    utf8proc_int32_t c = 0;
    utf8proc_ssize_t n = utf8proc_iterate(p, left, &c);
    FLAME_CHECK(n > 0, op, "the text is not valid UTF-8 at byte ", offset, " (", utf8proc_errmsg(n),
                "); captions must be UTF-8");
    out.push_back(static_cast<char32_t>(c));
    p += n;
    left -= n;
    offset += static_cast<size_t>(n);
  }
  return out;
}

std::u32string utf8_decode_nfc(std::string_view text, const char* op) {
  if (text.empty()) return {};
  utf8proc_uint8_t* dst = nullptr;
  // An explicit length (no UTF8PROC_NULLTERM): NUL characters are characters like any other.
  utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                    static_cast<utf8proc_ssize_t>(text.size()), &dst,
                                    static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(dst, &std::free);
  if (n < 0) utf8_decode(text, op);  // raises with the offset of the bad byte
  FLAME_CHECK(n >= 0, op, "NFC normalisation failed: ", utf8proc_errmsg(n));
  return utf8_decode(std::string_view(reinterpret_cast<const char*>(dst), static_cast<size_t>(n)), op);
}

bool is_white_space(char32_t c) {
  if ((c >= 0x9 && c <= 0xD) || c == 0x85) return true;
  if (c > 0x10FFFF) return false;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_ZS:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
      return true;
    default:
      return false;
  }
}

std::vector<TextSegment> split_special_tokens(std::string_view text,
                                              const std::vector<std::pair<std::string, int64_t>>& specials) {
  std::vector<TextSegment> out;
  size_t start = 0;  // of the pending plain segment
  size_t pos = 0;
  while (pos < text.size()) {
    size_t best_len = 0;
    int64_t best_id = -1;
    for (const auto& [tok, id] : specials) {
      if (tok.size() > best_len && text.compare(pos, tok.size(), tok) == 0) {
        best_len = tok.size();
        best_id = id;
      }
    }
    if (best_len == 0) {
      ++pos;
      continue;
    }
    if (pos > start) out.push_back({text.substr(start, pos - start), -1});
    out.push_back({std::string_view(), best_id});
    pos += best_len;
    start = pos;
  }
  if (start < text.size()) out.push_back({text.substr(start), -1});
  return out;
}

TokenIds pad_ids(std::vector<int64_t> ids, size_t length, int64_t pad) {
  TokenIds r;
  r.mask.assign(length, 0);
  std::fill(r.mask.begin(), r.mask.begin() + static_cast<std::ptrdiff_t>(std::min(ids.size(), length)), 1);
  ids.resize(length, pad);
  r.ids = std::move(ids);
  return r;
}

TokenIds truncate_and_pad(std::vector<int64_t> ids, size_t length, int64_t eos, int64_t pad) {
  if (ids.size() > length) {
    ids.resize(length);
    if (length > 0) ids.back() = eos;
  }
  return pad_ids(std::move(ids), length, pad);
}

TokenBatch stack_token_ids(const std::vector<TokenIds>& rows) {
  const int64_t b = static_cast<int64_t>(rows.size());
  const int64_t l = rows.empty() ? 0 : static_cast<int64_t>(rows[0].ids.size());
  std::vector<int64_t> ids, mask;
  ids.reserve(static_cast<size_t>(b * l));
  mask.reserve(static_cast<size_t>(b * l));
  for (const TokenIds& r : rows) {
    FLAME_CHECK(static_cast<int64_t>(r.ids.size()) == l && r.mask.size() == r.ids.size(), "stack_token_ids",
                "every row must have ", l, " ids and as many mask values, found ", r.ids.size(), " and ",
                r.mask.size());
    ids.insert(ids.end(), r.ids.begin(), r.ids.end());
    mask.insert(mask.end(), r.mask.begin(), r.mask.end());
  }
  return {flame::Tensor::from_vec(ids, {b, l}), flame::Tensor::from_vec(mask, {b, l})};
}

}  // namespace flame_diffusion::models
