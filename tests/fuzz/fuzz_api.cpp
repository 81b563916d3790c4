// API fuzzer: random valid and invalid calls through FLAME's public API on the CPU.
//
// Note [Fuzz contract]
// Every call either returns a result whose shape is consistent (numel = product of sizes, one
// stride per dim, every element readable, and op-specific sizes where they are cheap to know) or
// throws flame::Error. Anything else is a finding: another exception type escaping, a crash, or
// (in the ASan + UBSan build) a memory error or undefined behaviour. The driver keeps a small
// pool of tensors (at most kPoolElements elements each) and feeds them, with arguments drawn
// from small values and from extremes (0, -1, 2^32, 2^62 + 1, INT64_MIN/MAX, NaN, inf), to
// factories, views, joins, elementwise ops, reductions, indexing and printing.
//
// Two entry points share one driver:
//  - the seeded driver (main below): `flame_fuzz --seed S --seconds T` runs programs of
//    kCallsPerProgram calls with seeds S, S+1, ... and prints the seed of a failing program;
//  - libFuzzer (clang, -DFLAME_LIBFUZZER): LLVMFuzzerTestOneInput reads its choices from the
//    input bytes instead of a random generator.
// Memory: valid but huge requests are expected to fail cleanly; the driver caps the process's
// address space (or, under ASan, relies on ASAN_OPTIONS=max_allocation_size_mb) so that such an
// allocation fails fast instead of paging. See docs/testing-robustness.md.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <csignal>

#include <sys/resource.h>
#include <unistd.h>
#if defined(FLAME_FUZZ_SANITIZED)
#include <sanitizer/common_interface_defs.h>
#endif

#include "flame/flame.h"

namespace flame::fuzz {
namespace {

constexpr int64_t kPoolElements = 1 << 12;
constexpr std::size_t kPoolSize = 8;
constexpr int kCallsPerProgram = 64;

// The choices: a random generator (seeded driver) or the fuzzer's input bytes.
class Source {
 public:
  explicit Source(uint64_t seed) : rng_(seed) {}
  Source(const uint8_t* data, std::size_t size) : data_(data), size_(size), bytes_(true) {}
  uint64_t next() {
    if (!bytes_) return rng_();
    uint64_t v = 0;
    for (int i = 0; i < 8 && pos_ < size_; ++i) v = v << 8 | data_[pos_++];
    return v;
  }
  bool exhausted() const { return bytes_ && pos_ >= size_; }
  uint64_t below(uint64_t n) { return n == 0 ? 0 : next() % n; }
  bool chance(int percent) { return below(100) < static_cast<uint64_t>(percent); }

 private:
  std::mt19937_64 rng_{0};
  const uint8_t* data_ = nullptr;
  std::size_t size_ = 0, pos_ = 0;
  bool bytes_ = false;
};

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
const int64_t kExtremes[] = {0, 1, -1, -2, kMax, kMin, kMax / 2 + 1, int64_t(1) << 31, int64_t(1) << 32,
                             int64_t(1) << 53, int64_t(1) << 62, (int64_t(1) << 62) + 1, -(int64_t(1) << 62),
                             kMax - 1, kMin + 1, int64_t(1) << 40};

int64_t any_int(Source& s) {
  const uint64_t r = s.below(100);
  if (r < 55) return static_cast<int64_t>(s.below(14)) - 3;  // [-3, 10]
  if (r < 80) return static_cast<int64_t>(s.below(100));
  return kExtremes[s.below(std::size(kExtremes))];
}
int64_t size_arg(Source& s) { return s.chance(90) ? static_cast<int64_t>(s.below(6)) : any_int(s); }
int64_t dim_arg(Source& s) { return s.chance(92) ? static_cast<int64_t>(s.below(9)) - 4 : any_int(s); }
Shape shape_arg(Source& s, std::size_t max_dims = 4) {
  Shape sh(s.below(max_dims + 1));
  for (auto& v : sh) v = size_arg(s);
  return sh;
}
Shape int_list(Source& s, std::size_t max_len = 5) {
  Shape v(s.below(max_len + 1));
  for (auto& x : v) x = any_int(s);
  return v;
}
double any_double(Source& s) {
  static const double special[] = {0.0, -0.0, NAN, INFINITY, -INFINITY, 1e300, -1e300, 1e-300, 0.5, -1.5};
  if (s.chance(20)) return special[s.below(std::size(special))];
  return (static_cast<double>(s.below(2001)) - 1000.0) / 100.0;
}
DType dtype_arg(Source& s) { return kAllDTypes[s.below(std::size(kAllDTypes))]; }
Scalar scalar_arg(Source& s) {
  switch (s.below(3)) {
    case 0: return Scalar(any_int(s));
    case 1: return Scalar(any_double(s));
    default: return Scalar(s.chance(50));
  }
}

bool g_show_errors = false;  // --show-errors: print every flame::Error (to review the messages)

struct Stats {
  uint64_t calls = 0, ok = 0, errors = 0;
};

// Checks Note [Fuzz contract] on a result; returns false (and prints) on a violation.
bool consistent(const Tensor& t, const char* op) {
  if (!t.defined()) return true;  // e.g. a gradient that does not exist
  const Shape& sz = t.sizes();
  if (t.strides().size() != sz.size()) {
    std::fprintf(stderr, "fuzz: %s returned %zu strides for %zu dims\n", op, t.strides().size(), sz.size());
    return false;
  }
  __int128 n = 1;
  for (int64_t v : sz) {
    if (v < 0) {
      std::fprintf(stderr, "fuzz: %s returned a negative size in %s\n", op, shape_str(sz).c_str());
      return false;
    }
    n *= v;
    if (n > kMax) n = static_cast<__int128>(kMax) + 1;
  }
  if (n != t.numel()) {
    std::fprintf(stderr, "fuzz: %s returned numel %lld for shape %s\n", op, static_cast<long long>(t.numel()),
                 shape_str(sz).c_str());
    return false;
  }
  // Read every element of small results (ASan sees any read outside the allocation).
  if (t.numel() <= kPoolElements) (void)t.to_vec<double>();
  return true;
}

class Driver {
 public:
  explicit Driver(Source& s) : s_(s) {}

  // One program: a fresh pool, then calls until the budget or the input is spent.
  bool run(int calls, Stats& stats) {
    pool_.clear();
    for (int i = 0; i < calls && !s_.exhausted(); ++i) {
      ++stats.calls;
      op_ = "?";
      try {
        Tensor r = step();
        if (!consistent(r, op_)) return false;
        ++stats.ok;
        keep(r);
      } catch (const Error& e) {
        ++stats.errors;
        if (g_show_errors) std::printf("[%s] %s\n", op_, e.what());
      } catch (const std::exception& e) {
        std::fprintf(stderr, "fuzz: %s let a foreign exception escape: %s\n", op_, e.what());
        return false;
      } catch (...) {
        std::fprintf(stderr, "fuzz: %s threw a non-std exception\n", op_);
        return false;
      }
      if (!failure_.empty()) {
        std::fprintf(stderr, "fuzz: %s: %s\n", op_, failure_.c_str());
        return false;
      }
    }
    return true;
  }
  const char* last_op() const { return op_; }

 private:
  void keep(const Tensor& t) {
    if (!t.defined() || t.numel() > kPoolElements) return;
    if (pool_.size() < kPoolSize) pool_.push_back(t);
    else pool_[s_.below(kPoolSize)] = t;
  }
  Tensor pick() {
    if (pool_.empty() || s_.chance(10)) return fresh();
    return pool_[s_.below(pool_.size())];
  }
  // A small random tensor, sometimes a non-contiguous view of one.
  Tensor fresh() {
    Shape sh(s_.below(4));
    for (auto& v : sh) v = static_cast<int64_t>(s_.below(5));
    const DType dt = dtype_arg(s_);
    Tensor t = is_floating(dt) ? Tensor::randn(sh, 0.0, 3.0, dt)
                               : Tensor::randint(dt == DType::u8 ? 0 : -9, 10, sh, is_bool(dt) ? DType::i64 : dt);
    if (is_bool(dt)) t = t.gt(Tensor::scalar(0));
    if (t.dim() >= 2 && s_.chance(30)) t = t.transpose(0, 1);
    return t;
  }
  void expect(bool cond, const char* what) {
    if (!cond && failure_.empty()) failure_ = what;
  }
  // Small tensors' lists from split/chunk: check that the pieces tile the dim.
  Tensor pieces(const TensorList& parts, const Tensor& x, int64_t dim) {
    if (parts.empty()) return {};
    const int64_t d = dim < 0 ? dim + x.dim() : dim;
    int64_t total = 0;
    for (const Tensor& p : parts) {
      if (!consistent(p, op_)) expect(false, "a piece is inconsistent");
      total += p.size(d);
    }
    expect(total == x.size(d), "pieces do not add up to the split dim");
    return parts[s_.below(parts.size())];
  }

  Tensor step() {
    Source& s = s_;
    switch (s.below(52)) {
      // ---- factories ----
      case 0: op_ = "zeros"; return Tensor::zeros(shape_arg(s), dtype_arg(s));
      case 1: op_ = "ones"; return Tensor::ones(shape_arg(s), dtype_arg(s));
      case 2: op_ = "full"; return Tensor::full(shape_arg(s), scalar_arg(s), dtype_arg(s));
      case 3: op_ = "empty"; return Tensor::empty(shape_arg(s), dtype_arg(s));
      case 4: op_ = "arange(int)"; return Tensor::arange(any_int(s), any_int(s), any_int(s));
      case 5: op_ = "arange(float)"; return Tensor::arange(any_double(s), any_double(s), any_double(s), dtype_arg(s));
      case 6: op_ = "linspace"; return Tensor::linspace(any_double(s), any_double(s), any_int(s), dtype_arg(s));
      case 7: op_ = "eye"; return Tensor::eye(any_int(s), any_int(s), dtype_arg(s));
      case 8: op_ = "randn"; return Tensor::randn(shape_arg(s), any_double(s), any_double(s), dtype_arg(s));
      case 9: op_ = "randint"; return Tensor::randint(any_int(s), any_int(s), shape_arg(s), dtype_arg(s));
      case 10: op_ = "rand"; return Tensor::uniform(shape_arg(s), any_double(s), any_double(s), dtype_arg(s));
      // ---- views ----
      case 11: {
        op_ = "reshape";
        Tensor x = pick();
        Tensor r = s.chance(50) ? x.reshape(int_list(s, 4)) : x.view(int_list(s, 4));
        expect(r.numel() == x.numel(), "reshape changed numel");
        return r;
      }
      case 12: {
        op_ = "narrow";
        Tensor x = pick();
        const int64_t d = dim_arg(s), len = any_int(s);
        Tensor r = x.narrow(d, any_int(s), len);
        expect(r.dim() == x.dim() && r.size(d) == len, "narrow returned the wrong length");
        return r;
      }
      case 13: op_ = "slice"; return pick().slice(dim_arg(s), any_int(s), any_int(s), any_int(s));
      case 14: op_ = "select"; return pick().select(dim_arg(s), any_int(s));
      case 15: op_ = "transpose"; return pick().transpose(dim_arg(s), dim_arg(s));
      case 16: op_ = "permute"; return pick().permute(int_list(s, 4));
      case 17: op_ = "expand"; return pick().expand(int_list(s, 5));
      case 18: op_ = "squeeze/unsqueeze"; return s.chance(50) ? pick().squeeze(dim_arg(s)) : pick().unsqueeze(dim_arg(s));
      case 19: op_ = "flatten"; return pick().flatten(dim_arg(s), dim_arg(s));
      case 20: op_ = "unflatten"; return pick().unflatten(dim_arg(s), int_list(s, 3));
      case 21: op_ = "unfold"; return pick().unfold(dim_arg(s), any_int(s), any_int(s));
      // ---- joins ----
      case 22: op_ = "flip"; return pick().flip(int_list(s, 3));
      case 23: op_ = "repeat"; return pick().repeat(int_list(s, 4));
      case 24: {
        op_ = "split";
        Tensor x = pick();
        const int64_t d = dim_arg(s);
        return pieces(x.split(any_int(s), d), x, d);
      }
      case 25: {
        op_ = "split_with_sizes";
        Tensor x = pick();
        const int64_t d = dim_arg(s);
        return pieces(x.split_with_sizes(int_list(s, 4), d), x, d);
      }
      case 26: {
        op_ = "chunk";
        Tensor x = pick();
        const int64_t d = dim_arg(s);
        return pieces(x.chunk(any_int(s), d), x, d);
      }
      case 27: {
        op_ = "cat";
        TensorList ts(1 + s.below(3));
        for (auto& t : ts) t = pick();
        return cat(ts, dim_arg(s));
      }
      case 28: {
        op_ = "stack";
        Tensor x = pick();
        TensorList ts(1 + s.below(3), x);
        if (s.chance(30)) ts.back() = pick();
        return stack(ts, dim_arg(s));
      }
      case 29: op_ = "pad"; return pad(pick(), int_list(s, 6), static_cast<PadMode>(s.below(3)), any_double(s));
      // ---- elementwise ----
      case 30: {
        op_ = "binary";
        Tensor a = pick(), b = s.chance(30) ? a : pick();
        switch (s.below(9)) {
          case 0: return a + b;
          case 1: return a - b;
          case 2: return a * b;
          case 3: return a / b;
          case 4: return pow(a, b);
          case 5: return fmod(a, b);
          case 6: return maximum(a, b);
          case 7: return atan2(a, b);
          default: return a.lt(b);
        }
      }
      case 31: {
        op_ = "unary";
        Tensor a = pick();
        switch (s.below(10)) {
          case 0: return -a;
          case 1: return a.abs();
          case 2: return a.square();
          case 3: return a.exp();
          case 4: return a.sign();
          case 5: return a.relu();
          case 6: return a.round();
          case 7: return a.isnan();
          case 8: return a.nan_to_num();
          default: return a.sqrt();
        }
      }
      case 32: {
        op_ = "scalar op";
        Tensor a = pick();
        const Scalar v = scalar_arg(s);
        switch (s.below(6)) {
          case 0: return a.add_scalar(v);
          case 1: return a.sub_scalar(v);
          case 2: return a.mul_scalar(v);
          case 3: return a.div_scalar(v);
          case 4: return a.pow(v);
          default: return rsub_scalar(a, v);
        }
      }
      case 33: op_ = "clamp"; return pick().clamp(scalar_arg(s), scalar_arg(s));
      case 34: {
        op_ = "in-place";
        Tensor a = pick().clone();
        const Scalar v = scalar_arg(s);
        switch (s.below(7)) {
          case 0: a.add_(v); break;
          case 1: a.sub_(v); break;
          case 2: a.mul_(v); break;
          case 3: a.fill_(v); break;
          case 4: a.add_(pick()); break;
          case 5: a.copy_(pick()); break;
          default: a.sub_(pick()); break;
        }
        return a;
      }
      case 35: op_ = "to"; return pick().to(dtype_arg(s));
      case 36: op_ = "where"; return where(pick().gt(pick()), pick(), pick());
      // ---- reductions ----
      case 37: op_ = "sum"; return sum(pick(), int_list(s, 2), s.chance(50));
      case 38: op_ = "mean/amax"; return s.chance(50) ? mean(pick(), int_list(s, 2)) : amax(pick(), int_list(s, 2));
      case 39: op_ = "argmax"; return argmax(pick(), dim_arg(s), s.chance(50));
      case 40: op_ = "cumsum"; return cumsum(pick(), dim_arg(s));
      case 41: op_ = "softmax"; return softmax(pick(), dim_arg(s));
      case 42: op_ = "var"; return var(pick(), int_list(s, 2), any_int(s));
      // ---- indexing ----
      case 43: op_ = "index_select"; return index_select(pick(), dim_arg(s), pick());
      case 44: op_ = "gather"; return gather(pick(), dim_arg(s), pick());
      case 45: op_ = "scatter_add"; return scatter_add(pick(), dim_arg(s), pick(), pick());
      case 46: op_ = "take"; return take(pick(), pick());
      case 47: op_ = "one_hot"; return one_hot(pick(), any_int(s));
      case 48: op_ = "topk"; return topk(pick(), any_int(s), dim_arg(s)).first;
      case 49: op_ = "matmul"; return matmul(pick(), pick());
      case 50: {
        op_ = "print";
        (void)pick().to_string();
        return {};
      }
      default: op_ = "tril"; return tril(pick(), any_int(s));
    }
  }

  Source& s_;
  std::vector<Tensor> pool_;
  const char* op_ = "?";
  std::string failure_;
};

// Valid but enormous requests must fail inside FLAME, quickly: cap the address space (not under
// ASan, which reserves terabytes of shadow; there ASAN_OPTIONS=max_allocation_size_mb does it).
void limit_memory() {
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
  return;
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
  return;
#endif
  rlimit lim{};
  lim.rlim_cur = lim.rlim_max = rlim_t(2) << 30;
  setrlimit(RLIMIT_AS, &lim);
}

// The program being run, for the report of a crash (a signal or a sanitizer's death).
volatile uint64_t g_program = 0;
void report_program() {
  char buf[96];
  const int n = std::snprintf(buf, sizeof(buf), "fuzz: crashed in program --seed %llu --programs 1\n",
                              static_cast<unsigned long long>(g_program));
  if (n > 0) (void)!write(2, buf, static_cast<std::size_t>(n));
}
void on_signal(int sig) {
  report_program();
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}
void install_crash_report() {
#if defined(FLAME_FUZZ_SANITIZED)
  __sanitizer_set_death_callback(report_program);
#else
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) std::signal(sig, on_signal);
#endif
}

}  // namespace
}  // namespace flame::fuzz

#if defined(FLAME_LIBFUZZER)
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  flame::fuzz::limit_memory();
  return 0;
}
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  flame::fuzz::Source src(data, size);
  flame::fuzz::Driver driver(src);
  flame::fuzz::Stats stats;
  if (!driver.run(1 << 20, stats)) std::abort();
  return 0;
}
#else
int main(int argc, char** argv) {
  uint64_t seed = 1;
  double seconds = 5.0;
  uint64_t programs = 0;  // 0: until the time is up
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--seed")) seed = std::strtoull(argv[i + 1], nullptr, 10);
    else if (!std::strcmp(argv[i], "--seconds")) seconds = std::strtod(argv[i + 1], nullptr);
    else if (!std::strcmp(argv[i], "--programs")) programs = std::strtoull(argv[i + 1], nullptr, 10);
    else if (!std::strcmp(argv[i], "--show-errors")) flame::fuzz::g_show_errors = argv[i + 1][0] == '1';
    else {
      std::fprintf(stderr, "usage: flame_fuzz [--seed S] [--seconds T] [--programs N] [--show-errors 1]\n");
      return 2;
    }
  }
  flame::fuzz::limit_memory();
  flame::fuzz::install_crash_report();
  const bool trace = std::getenv("FLAME_FUZZ_TRACE") != nullptr;
  flame::fuzz::Stats stats;
  const auto start = std::chrono::steady_clock::now();
  uint64_t done = 0;
  for (uint64_t p = seed;; ++p) {
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (programs ? done >= programs : elapsed >= seconds) break;
    flame::fuzz::g_program = p;
    // Not every sanitizer runs the death callback (GCC's UBSan does not): FLAME_FUZZ_TRACE=1
    // names each program before it runs, so the last line before a report is the one to replay.
    if (trace) std::fprintf(stderr, "fuzz: program %llu\n", static_cast<unsigned long long>(p));
    flame::fuzz::Source src(p);
    flame::fuzz::Driver driver(src);
    if (!driver.run(flame::fuzz::kCallsPerProgram, stats)) {
      std::fprintf(stderr, "fuzz: FAILED in program --seed %llu --programs 1 (op %s)\n",
                   static_cast<unsigned long long>(p), driver.last_op());
      return 1;
    }
    ++done;
  }
  std::printf("fuzz: %llu programs, %llu calls: %llu returned a consistent result, %llu raised flame::Error\n",
              static_cast<unsigned long long>(done), static_cast<unsigned long long>(stats.calls),
              static_cast<unsigned long long>(stats.ok), static_cast<unsigned long long>(stats.errors));
  return 0;
}
#endif
