// Fuzzer of the IDX reader (src/data/idx.cpp, flame::data), built alone with zlib: no FLAME library.
//
// Note [IDX fuzz contract]
// For any bytes, decode_idx_container (gunzip when the gzip magic is there) followed by parse_idx
// either throws IdxError or returns an array whose dimensions are in 1..2^31-1, whose element
// count is their product and equals the data size, and whose re-encoding (encode_idx) is exactly
// the decoded bytes (the parser accepts only files that are exactly what their header says). A
// gzip'd re-encoding decodes to the same array. Anything else is a finding: another exception, a
// crash, or (under ASan/UBSan) an out-of-bounds read or undefined behaviour. Inputs are copied into
// a buffer of exactly their size so that ASan sees any read past the end.
//
// Two entry points:
//  - the seeded mutation driver (main): `flame_fuzz_idx --seed S --seconds T` mutates valid files,
//    plain and gzip'd (bit flips, interesting bytes, truncation, insertions, deletions, dimension
//    fields set to extremes, magic edits) and prints counts; `--write-corpus DIR` writes valid
//    seeds for libFuzzer;
//  - libFuzzer (clang, -DFLAME_LIBFUZZER=ON or tests/fuzz/run_libfuzzer_idx.sh):
//    LLVMFuzzerTestOneInput runs the same check on the fuzzer's bytes.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "flame/data/idx.h"

namespace fd = flame::data;

namespace {

struct Stats {
  uint64_t runs = 0, parsed = 0, refused = 0;
};

// Note [IDX fuzz contract]. Returns false (after printing why) on a finding.
bool check_one(const uint8_t* input, std::size_t size, Stats& stats) {
  std::unique_ptr<uint8_t[]> buf(new uint8_t[size > 0 ? size : 1]);
  if (size > 0) std::memcpy(buf.get(), input, size);
  ++stats.runs;
  std::vector<uint8_t> decoded;
  fd::IdxArray a;
  try {
    if (fd::is_gzip(buf.get(), size)) {
      decoded = fd::gunzip(buf.get(), size, "fuzz", std::size_t{1} << 26);
    } else {
      decoded.assign(buf.get(), buf.get() + size);
    }
    // Parse from an exact-size copy too, so that reads past the decoded data are caught.
    std::unique_ptr<uint8_t[]> exact(new uint8_t[decoded.size() > 0 ? decoded.size() : 1]);
    if (!decoded.empty()) std::memcpy(exact.get(), decoded.data(), decoded.size());
    a = fd::parse_idx(exact.get(), decoded.size(), "fuzz");
  } catch (const fd::IdxError&) {
    ++stats.refused;
    return true;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: a foreign exception: %s\n", e.what());
    return false;
  }
  ++stats.parsed;
  uint64_t numel = 1;
  for (int64_t d : a.dims) {
    if (d < 1 || d > 0x7fffffff) {
      std::fprintf(stderr, "fuzz: accepted dimension %lld\n", static_cast<long long>(d));
      return false;
    }
    numel *= static_cast<uint64_t>(d);
  }
  if (a.dims.empty() || a.dims.size() > 4 || numel != a.data.size() || numel > fd::kMaxIdxElements) {
    std::fprintf(stderr, "fuzz: accepted an inconsistent array (%zu dims, %llu elements, %zu bytes)\n", a.dims.size(),
                 static_cast<unsigned long long>(numel), a.data.size());
    return false;
  }
  try {
    if (fd::encode_idx(a.dims, a.data) != decoded) {
      std::fprintf(stderr, "fuzz: re-encoding differs from the accepted bytes\n");
      return false;
    }
    const std::vector<uint8_t> z = fd::gzip(decoded);
    const std::vector<uint8_t> back = fd::decode_idx_container(z, "fuzz-gz");
    const fd::IdxArray b = fd::parse_idx(back.data(), back.size(), "fuzz-gz");
    if (b.dims != a.dims || b.data != a.data) {
      std::fprintf(stderr, "fuzz: a gzip round trip changed the array\n");
      return false;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: an accepted array could not be rewritten: %s\n", e.what());
    return false;
  }
  return true;
}

using Rng = std::mt19937_64;

std::vector<uint8_t> valid_file(Rng& rng) {
  const int nd = 1 + static_cast<int>(rng() % 4);
  std::vector<int64_t> dims;
  uint64_t numel = 1;
  for (int d = 0; d < nd; ++d) {
    dims.push_back(1 + static_cast<int64_t>(rng() % 6));
    numel *= static_cast<uint64_t>(dims.back());
  }
  std::vector<uint8_t> data(numel);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  return fd::encode_idx(dims, data);
}

const uint32_t kDims[] = {0, 1, 2, 28, 255, 256, 65536, 0x7fffffff, 0x80000000, 0xffffffff, 1u << 30, 1u << 15};
const uint8_t kInteresting[] = {0x00, 0x01, 0x03, 0x04, 0x05, 0x08, 0x09, 0x0d, 0x1f, 0x7f, 0x80, 0x8b, 0xff};

std::vector<uint8_t> mutate(std::vector<uint8_t> f, Rng& rng) {
  const int rounds = 1 + static_cast<int>(rng() % 3);
  for (int r = 0; r < rounds; ++r) {
    switch (rng() % 7) {
      case 0:  // bit flip
        if (!f.empty()) f[rng() % f.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
        break;
      case 1:  // interesting byte
        if (!f.empty()) f[rng() % f.size()] = kInteresting[rng() % sizeof kInteresting];
        break;
      case 2:  // truncate
        f.resize(f.empty() ? 0 : rng() % f.size());
        break;
      case 3: {  // insert
        const std::size_t at = f.empty() ? 0 : rng() % (f.size() + 1);
        f.insert(f.begin() + static_cast<std::ptrdiff_t>(at), 1 + rng() % 8, static_cast<uint8_t>(rng()));
        break;
      }
      case 4:  // delete
        if (!f.empty()) f.erase(f.begin() + static_cast<std::ptrdiff_t>(rng() % f.size()));
        break;
      case 5: {  // a dimension field set to an extreme
        const std::size_t nd = f.size() >= 4 ? f[3] : 0;
        if (nd > 0 && f.size() >= 4 + 4 * std::min<std::size_t>(nd, 4)) {
          const std::size_t d = rng() % std::min<std::size_t>(nd, 4);
          const uint32_t v = kDims[rng() % (sizeof kDims / sizeof kDims[0])];
          for (int k = 0; k < 4; ++k) f[4 + 4 * d + k] = static_cast<uint8_t>(v >> (24 - 8 * k));
        }
        break;
      }
      default:  // the magic's type or dimension count
        if (f.size() >= 4) f[2 + rng() % 2] = kInteresting[rng() % sizeof kInteresting];
        break;
    }
  }
  return f;
}

int seeded_main(int argc, char** argv) {
  uint64_t seed = 1;
  double seconds = 10;
  std::string corpus;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--seed" && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--seconds" && i + 1 < argc) {
      seconds = std::atof(argv[++i]);
    } else if (a == "--write-corpus" && i + 1 < argc) {
      corpus = argv[++i];
    } else {
      std::fprintf(stderr, "usage: flame_fuzz_idx [--seed S] [--seconds T] [--write-corpus DIR]\n");
      return 2;
    }
  }
  Rng rng(seed);
  if (!corpus.empty()) {
    for (int i = 0; i < 32; ++i) {
      std::vector<uint8_t> f = valid_file(rng);
      if (i % 2) f = fd::gzip(f);
      std::ofstream(corpus + "/seed" + std::to_string(i), std::ios::binary)
          .write(reinterpret_cast<const char*>(f.data()), static_cast<std::streamsize>(f.size()));
    }
    return 0;
  }
  Stats stats;
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds) {
    for (int k = 0; k < 64; ++k) {
      std::vector<uint8_t> f = valid_file(rng);
      const int how = static_cast<int>(rng() % 4);
      if (how == 1) f = fd::gzip(mutate(f, rng));       // a corrupt IDX inside a valid gzip
      else if (how == 2) f = mutate(fd::gzip(f), rng);  // a corrupt gzip stream
      else if (how == 3) f = mutate(f, rng);
      if (!check_one(f.data(), f.size(), stats)) {
        std::fprintf(stderr, "fuzz: finding with seed %llu after %llu runs\n", static_cast<unsigned long long>(seed),
                     static_cast<unsigned long long>(stats.runs));
        return 1;
      }
    }
  }
  std::printf("fuzz_idx: %llu inputs, %llu parsed, %llu refused with IdxError\n",
              static_cast<unsigned long long>(stats.runs), static_cast<unsigned long long>(stats.parsed),
              static_cast<unsigned long long>(stats.refused));
  // Both outcomes must have been exercised, or the mutations are not reaching the parser.
  return stats.parsed > 0 && stats.refused > 0 ? 0 : 1;
}

}  // namespace

#ifdef FLAME_LIBFUZZER
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  Stats stats;
  if (!check_one(data, size, stats)) std::abort();
  return 0;
}
#else
int main(int argc, char** argv) { return seeded_main(argc, argv); }
#endif
