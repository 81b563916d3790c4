// Fuzzer of the safetensors header parser (src/io/safetensors_format.cpp), built alone: no
// Tensor, no backend.
//
// Note [Safetensors fuzz contract]
// For any bytes, format::parse either throws flame::Error or returns a header whose entries lie
// inside the data, tile it exactly, have size = shape product x dtype size and unique names; and
// writing that header back with serialize_header and parsing it again gives the same entries and
// metadata. Anything else is a finding: another exception, a crash, or (under ASan/UBSan) an
// out-of-bounds read or undefined behaviour. Inputs are copied into a buffer of exactly their size
// so that ASan sees any read past the end.
//
// Two entry points:
//  - the seeded mutation driver (main): `flame_fuzz_safetensors --seed S --seconds T` mutates
//    valid files (bit flips, interesting bytes, truncation, insertions, deletions, splices, edited
//    length fields, numbers in the header replaced by extremes, copied keys) and prints counts;
//  - libFuzzer (clang, -DFLAME_LIBFUZZER=ON or tests/fuzz/run_libfuzzer_safetensors.sh):
//    LLVMFuzzerTestOneInput runs the same check on the fuzzer's bytes.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "flame/error.h"
#include "src/io/safetensors_format.h"

namespace flame::fuzz_st {
namespace {

namespace fmt = flame::io::format;

struct Stats {
  uint64_t runs = 0, parsed = 0, refused = 0;
};

bool same_entries(const fmt::Header& a, const fmt::Header& b) {
  if (a.entries.size() != b.entries.size() || a.metadata != b.metadata) return false;
  for (std::size_t i = 0; i < a.entries.size(); ++i) {
    const fmt::Entry &x = a.entries[i], &y = b.entries[i];
    if (x.name != y.name || x.dtype != y.dtype || x.shape != y.shape || x.begin != y.begin || x.end != y.end) {
      return false;
    }
  }
  return true;
}

// Note [Safetensors fuzz contract]. Returns false (after printing why) on a finding.
bool check_one(const unsigned char* input, std::size_t size, Stats& stats) {
  std::unique_ptr<unsigned char[]> buf(new unsigned char[size > 0 ? size : 1]);
  if (size > 0) std::memcpy(buf.get(), input, size);
  ++stats.runs;
  fmt::Header h;
  try {
    h = fmt::parse(buf.get(), size, "fuzz");
  } catch (const flame::Error&) {
    ++stats.refused;
    return true;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: parse threw a foreign exception: %s\n", e.what());
    return false;
  }
  ++stats.parsed;
  uint64_t total = 0;
  std::set<std::string> names;
  for (const fmt::Entry& e : h.entries) {
    uint64_t numel = 1;
    for (uint64_t d : e.shape) numel *= d;  // bounded by the parser's checks
    if (e.begin > e.end || e.end > h.data_bytes || e.end - e.begin != numel * fmt::dtype_bytes(e.dtype) ||
        !names.insert(e.name).second) {
      std::fprintf(stderr, "fuzz: accepted an inconsistent entry (begin %llu end %llu data %llu)\n",
                   static_cast<unsigned long long>(e.begin), static_cast<unsigned long long>(e.end),
                   static_cast<unsigned long long>(h.data_bytes));
      return false;
    }
    total += e.end - e.begin;
  }
  if (total != h.data_bytes || h.data_start + h.data_bytes != size) {
    std::fprintf(stderr, "fuzz: accepted data that the tensors do not tile\n");
    return false;
  }
  // What was accepted must survive a write and a re-read unchanged.
  try {
    std::string again = fmt::serialize_header(h.entries, h.metadata, "fuzz-rewrite");
    again.append(reinterpret_cast<const char*>(buf.get() + h.data_start), h.data_bytes);
    const fmt::Header h2 = fmt::parse(reinterpret_cast<const unsigned char*>(again.data()), again.size(), "fuzz-reread");
    if (!same_entries(h, h2)) {
      std::fprintf(stderr, "fuzz: a header changed through write and re-read\n");
      return false;
    }
  } catch (const flame::Error& e) {
    std::fprintf(stderr, "fuzz: an accepted header could not be rewritten: %s\n", e.what());
    return false;
  }
  return true;
}

// ---- the seeded mutation driver ----

using Rng = std::mt19937_64;

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A valid file of a few tensors of random dtypes and shapes (some empty, some 0-d).
std::string valid_file(Rng& rng) {
  std::vector<fmt::Entry> entries;
  const int n = static_cast<int>(rng() % 5);
  uint64_t offset = 0;
  for (int i = 0; i < n; ++i) {
    fmt::Entry e;
    e.name = (rng() % 4 == 0) ? "layer." + std::to_string(i) + ".w\xc3\xa9" : "t" + std::to_string(i);
    e.dtype = static_cast<fmt::StDType>(rng() % (static_cast<int>(fmt::StDType::C64) + 1));
    const int nd = static_cast<int>(rng() % 4);
    uint64_t numel = 1;
    for (int d = 0; d < nd; ++d) {
      e.shape.push_back(rng() % 5);
      numel *= e.shape.back();
    }
    e.begin = offset;
    offset += numel * fmt::dtype_bytes(e.dtype);
    e.end = offset;
    entries.push_back(e);
  }
  std::vector<std::pair<std::string, std::string>> meta;
  if (rng() % 2) meta.emplace_back("format", "pt");
  if (rng() % 3 == 0) meta.emplace_back("k\"", "v\\\n");
  std::string out = fmt::serialize_header(entries, meta, "seed");
  for (uint64_t i = 0; i < offset; ++i) out.push_back(static_cast<char>(rng()));
  return out;
}

const char kInteresting[] = {'\0', '\xff', '{', '}', '[', ']', '"', ',', ':', '-', '0', '1', '9', ' ', '.', 'e', '\\', '\x80'};
const char* const kNumbers[] = {"-1", "0", "1", "9223372036854775807", "9223372036854775808", "18446744073709551615",
                                "18446744073709551616", "1e400", "1.5", "-0", "4294967296", "99999999999999999999999"};
const uint64_t kLengths[] = {0, 1, 7, 8, 100000000, 100000001, uint64_t{1} << 63, ~uint64_t{0}, 0x7fffffffffffffffULL};

uint64_t header_len(const std::string& f) {
  uint64_t n = 0;
  for (int i = 7; i >= 0 && static_cast<std::size_t>(i) < f.size(); --i) n = n << 8 | static_cast<unsigned char>(f[i]);
  return n;
}

void mutate(std::string& f, const std::string& other, Rng& rng) {
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int k = 0; k < edits; ++k) {
    const std::size_t sz = f.size();
    const uint64_t hl = header_len(f);
    // Aim most edits at the header, where the parser works.
    const std::size_t hend = std::min<std::size_t>(sz, 8 + std::min<uint64_t>(hl, sz));
    auto pos = [&](bool header) -> std::size_t {
      if (sz == 0) return 0;
      if (header && hend > 8 && rng() % 4 != 0) return 8 + rng() % (hend - 8);
      return rng() % sz;
    };
    bool fix_length = false;
    switch (rng() % 10) {
      case 0:
        if (sz) f[pos(true)] ^= static_cast<char>(1u << (rng() % 8));
        break;
      case 1:
        if (sz) f[pos(true)] = kInteresting[rng() % sizeof(kInteresting)];
        break;
      case 2:
        f.resize(sz ? rng() % sz : 0);
        break;
      case 3: {  // insert bytes inside the header, then keep the length consistent
        const std::size_t p = pos(true);
        std::string ins;
        for (int i = 0, n = 1 + static_cast<int>(rng() % 8); i < n; ++i) ins.push_back(kInteresting[rng() % sizeof(kInteresting)]);
        f.insert(std::min(p, f.size()), ins);
        fix_length = p >= 8 && p < hend;
        break;
      }
      case 4: {
        const std::size_t p = pos(true);
        const std::size_t n = 1 + rng() % 16;
        if (p < f.size()) f.erase(p, n);
        fix_length = p >= 8 && p < hend;
        break;
      }
      case 5: {  // replace the length field
        const uint64_t v = rng() % 3 == 0 ? rng() : (rng() % 2 ? kLengths[rng() % std::size(kLengths)] : hl + rng() % 17 - 8);
        if (f.size() < 8) f.resize(8, '\0');
        f.replace(0, 8, le64(v));
        break;
      }
      case 6: {  // replace a number in the header by an extreme one
        for (int tries = 0; tries < 8 && hend > 8; ++tries) {
          std::size_t p = pos(true);
          if (p >= f.size() || f[p] < '0' || f[p] > '9') continue;
          std::size_t b = p, e = p;
          while (b > 8 && f[b - 1] >= '0' && f[b - 1] <= '9') --b;
          while (e < hend && e < f.size() && f[e] >= '0' && f[e] <= '9') ++e;
          f.replace(b, e - b, kNumbers[rng() % std::size(kNumbers)]);
          fix_length = true;
          break;
        }
        break;
      }
      case 7: {  // copy a span of the header elsewhere in it (duplicate keys, nested junk)
        if (hend <= 9) break;
        const std::size_t a = 8 + rng() % (hend - 8), n = 1 + rng() % 40;
        const std::string span = f.substr(a, std::min(n, hend - a));
        f.insert(8 + rng() % (hend - 8), span);
        fix_length = true;
        break;
      }
      case 8: {  // splice the tail of another file
        const std::size_t a = sz ? rng() % sz : 0, b = other.empty() ? 0 : rng() % other.size();
        f = f.substr(0, a) + other.substr(b);
        break;
      }
      default: {  // change the data size
        if (rng() % 2) {
          f.append(1 + rng() % 9, '\x5a');
        } else if (f.size() > hend) {
          f.resize(f.size() - 1);
        }
        break;
      }
    }
    if (fix_length && f.size() >= 8) {
      // Unsigned, so a length field that was already extreme wraps instead of overflowing.
      f.replace(0, 8, le64(hl + static_cast<uint64_t>(f.size()) - static_cast<uint64_t>(sz)));
    }
  }
}

}  // namespace
}  // namespace flame::fuzz_st

#if defined(FLAME_LIBFUZZER)
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  flame::fuzz_st::Stats stats;
  if (!flame::fuzz_st::check_one(data, size, stats)) std::abort();
  return 0;
}
#else
int main(int argc, char** argv) {
  using namespace flame::fuzz_st;
  uint64_t seed = 1;
  double seconds = 10.0;
  uint64_t iterations = 0;  // 0: until the time is up
  const char* corpus = nullptr;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--seed")) seed = std::strtoull(argv[i + 1], nullptr, 10);
    else if (!std::strcmp(argv[i], "--seconds")) seconds = std::strtod(argv[i + 1], nullptr);
    else if (!std::strcmp(argv[i], "--iterations")) iterations = std::strtoull(argv[i + 1], nullptr, 10);
    else if (!std::strcmp(argv[i], "--write-corpus")) corpus = argv[i + 1];
    else {
      std::fprintf(stderr, "usage: flame_fuzz_safetensors [--seed S] [--seconds T] [--iterations N] [--write-corpus DIR]\n");
      return 2;
    }
  }
  if (corpus != nullptr) {  // valid files to start libFuzzer from
    for (uint64_t k = 0; k < 64; ++k) {
      Rng rng(seed + k);
      const std::string f = valid_file(rng);
      const std::string path = std::string(corpus) + "/seed" + std::to_string(k) + ".safetensors";
      std::FILE* out = std::fopen(path.c_str(), "wb");
      if (out == nullptr || std::fwrite(f.data(), 1, f.size(), out) != f.size()) return 1;
      std::fclose(out);
    }
    return 0;
  }
  Stats stats;
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t it = 0;; ++it) {
    if (iterations ? it >= iterations
                   : (it % 64 == 0 &&
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >= seconds)) {
      break;
    }
    // Each case is reproducible from its own seed: --seed <that> --iterations 1.
    Rng rng(seed + it);
    std::string f = valid_file(rng);
    const std::string other = valid_file(rng);
    const uint64_t refused_before = stats.refused;
    if (!check_one(reinterpret_cast<const unsigned char*>(f.data()), f.size(), stats) ||
        stats.refused != refused_before) {
      std::fprintf(stderr, "fuzz: a valid seed file was refused or broke the contract (--seed %llu)\n",
                   static_cast<unsigned long long>(seed + it));
      return 1;
    }
    mutate(f, other, rng);
    if (!check_one(reinterpret_cast<const unsigned char*>(f.data()), f.size(), stats)) {
      std::fprintf(stderr, "fuzz: FAILED at --seed %llu --iterations 1\n", static_cast<unsigned long long>(seed + it));
      return 1;
    }
  }
  // The counts include the unmutated seed files (one per mutated input), all parsed.
  std::printf("fuzz_safetensors: %llu inputs: %llu parsed, %llu refused with flame::Error\n",
              static_cast<unsigned long long>(stats.runs), static_cast<unsigned long long>(stats.parsed),
              static_cast<unsigned long long>(stats.refused));
  return 0;
}
#endif
