// CPU reference GEMM: dst[B, M, N] (contiguous) = a[B, M, K] @ b[B, K, N] (any strides).
//
// Note [CPU GEMM]
// With FLAME_WITH_CBLAS, f32 and f64 go to OpenBLAS (cblas_sgemm/dgemm, one call per batch), and
// bf16/f16 are widened exactly into f32 buffers for sgemm. BLAS reads a row-major operand either
// as is (column stride 1) or transposed (row stride 1), with a leading dimension at least its
// width; an operand with other strides (expanded rows, a step in both dims) is first copied
// contiguous, once when its batch stride is 0. Everything else (no BLAS, integers) runs the packed
// loops: each operand is converted to the accumulator type into a row-major buffer (float for
// f32/bf16/f16 like cuBLAS, double for f64, wrapping uint64 for integers so overflow wraps as in
// PyTorch), then blocked i-k-j loops run over contiguous rows so the compiler vectorises them.
#include <algorithm>
#include <climits>
#include <optional>
#include <vector>

#include "src/backend/cpu/cpu_backend.h"
#include "src/backend/cpu/cpu_threads.h"
#include "src/opdef/scalar_math.h"

#ifdef FLAME_WITH_CBLAS
#include <cblas.h>
#endif

namespace flame::backend::cpu {
namespace {

struct Gemm {
  int64_t batch, m, k, n;
};

template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double,
                                 std::conditional_t<std::is_integral_v<T>, uint64_t, float>>;

// Copies matrix `bi` of t ([B, rows, cols], strided) into a row-major buffer of Acc.
template <class T, class Acc>
void pack(std::vector<Acc>& buf, const Tensor& t, int64_t bi) {
  const int64_t rows = t.size(1), cols = t.size(2);
  const int64_t s0 = t.stride(0), s1 = t.stride(1), s2 = t.stride(2);
  const T* base = static_cast<const T*>(t.data_ptr()) + bi * s0;
  buf.resize(static_cast<std::size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = base + r * s1;
    Acc* d = buf.data() + r * cols;
    if (s2 == 1) {
      for (int64_t c = 0; c < cols; ++c) d[c] = convert<Acc>(src[c]);
    } else {
      for (int64_t c = 0; c < cols; ++c) d[c] = convert<Acc>(src[c * s2]);
    }
  }
}

template <class T>
void gemm_loops(const Tensor& dst, const Tensor& a, const Tensor& b, const Gemm& g) {
  using Acc = acc_t<T>;
  // Block sizes: a KC x NC panel of b (128 x 256 floats = 128 KiB) stays in L2 while every row of a
  // streams past it.
  constexpr int64_t kKc = 128, kNc = 256;
  std::vector<Acc> ap, bp, c(static_cast<std::size_t>(g.m * g.n));
  T* out = static_cast<T*>(dst.data_ptr());
  for (int64_t bi = 0; bi < g.batch; ++bi) {
    // A batch stride of 0 (broadcast operand) means the packed copy is still valid.
    if (bi == 0 || a.stride(0) != 0) pack<T>(ap, a, bi);
    if (bi == 0 || b.stride(0) != 0) pack<T>(bp, b, bi);
    std::fill(c.begin(), c.end(), Acc(0));
    for (int64_t j0 = 0; j0 < g.n; j0 += kNc) {
      const int64_t nc = std::min(kNc, g.n - j0);
      for (int64_t k0 = 0; k0 < g.k; k0 += kKc) {
        const int64_t kc = std::min(kKc, g.k - k0);
        for (int64_t i = 0; i < g.m; ++i) {
          Acc* __restrict crow = c.data() + i * g.n + j0;
          const Acc* arow = ap.data() + i * g.k + k0;
          for (int64_t kk = 0; kk < kc; ++kk) {
            const Acc av = arow[kk];
            const Acc* __restrict brow = bp.data() + (k0 + kk) * g.n + j0;
            for (int64_t jj = 0; jj < nc; ++jj) crow[jj] += av * brow[jj];
          }
        }
      }
    }
    T* o = out + bi * g.m * g.n;
    for (int64_t i = 0, e = g.m * g.n; i < e; ++i) {
      if constexpr (std::is_integral_v<T>) {
        o[i] = static_cast<T>(static_cast<int64_t>(c[i]));  // modular, as PyTorch's integer overflow
      } else {
        o[i] = convert<T>(c[i]);
      }
    }
  }
}

#ifdef FLAME_WITH_CBLAS
// Below this many multiply-adds a GEMM runs on one thread (waking a worker costs microseconds).
constexpr int64_t kParallelGemmFlops = int64_t{1} << 18;

bool fits_int(int64_t v) { return v >= 0 && v <= INT_MAX; }

// How BLAS can read the row-major [rows, cols] matrices with row stride rs and column stride cs:
// as is or transposed, and the leading dimension. A dim of size 1 accepts any stride.
std::optional<std::pair<CBLAS_TRANSPOSE, int64_t>> blas_layout(int64_t rows, int64_t cols, int64_t rs,
                                                                int64_t cs) {
  if ((cols == 1 || cs == 1) && (rows == 1 || rs >= std::max<int64_t>(1, cols))) {
    const int64_t ld = rows == 1 ? std::max<int64_t>(1, cols) : rs;
    if (fits_int(ld)) return std::make_pair(CblasNoTrans, ld);
  }
  if ((rows == 1 || rs == 1) && (cols == 1 || cs >= std::max<int64_t>(1, rows))) {
    const int64_t ld = cols == 1 ? std::max<int64_t>(1, rows) : cs;
    if (fits_int(ld)) return std::make_pair(CblasTrans, ld);
  }
  return std::nullopt;
}

struct BlasOperand {
  Tensor t;  // [B, rows, cols] view BLAS can read (maybe a contiguous copy)
  CBLAS_TRANSPOSE trans;
  int64_t ld;
};

BlasOperand blas_operand(const Tensor& t) {
  const int64_t rows = t.size(1), cols = t.size(2);
  if (auto l = blas_layout(rows, cols, t.stride(1), t.stride(2))) return {t, l->first, l->second};
  // Copy what BLAS cannot read; a broadcast operand (batch stride 0) is copied once.
  Tensor c = t.stride(0) == 0 ? make_view(t, {1, rows, cols}, {0, t.stride(1), t.stride(2)}, t.storage_offset())
                                    .contiguous()
                              : t.contiguous();
  if (t.stride(0) == 0) c = make_view(c, t.sizes(), {0, cols, 1}, c.storage_offset());
  return {c, CblasNoTrans, std::max<int64_t>(1, cols)};
}

template <class T>
void gemm_blas(const Tensor& dst, const Tensor& a, const Tensor& b, const Gemm& g) {
  const BlasOperand pa = blas_operand(a), pb = blas_operand(b);
  const T* ab = static_cast<const T*>(pa.t.data_ptr());
  const T* bb = static_cast<const T*>(pb.t.data_ptr());
  T* out = static_cast<T*>(dst.data_ptr());
  // C rows [i0, i1) and columns [j0, j1) of batch entry bi.
  auto block = [&](int64_t bi, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    const T* ap = ab + bi * pa.t.stride(0) + (pa.trans == CblasNoTrans ? i0 * pa.ld : i0);
    const T* bp = bb + bi * pb.t.stride(0) + (pb.trans == CblasNoTrans ? j0 : j0 * pb.ld);
    T* cp = out + bi * g.m * g.n + i0 * g.n + j0;
    const int m = static_cast<int>(i1 - i0), n = static_cast<int>(j1 - j0), k = static_cast<int>(g.k);
    if (m == 0 || n == 0) return;
    if constexpr (std::is_same_v<T, float>) {
      cblas_sgemm(CblasRowMajor, pa.trans, pb.trans, m, n, k, 1.0f, ap, static_cast<int>(pa.ld), bp,
                  static_cast<int>(pb.ld), 0.0f, cp, static_cast<int>(g.n));
    } else {
      cblas_dgemm(CblasRowMajor, pa.trans, pb.trans, m, n, k, 1.0, ap, static_cast<int>(pa.ld), bp,
                  static_cast<int>(pb.ld), 0.0, cp, static_cast<int>(g.n));
    }
  };
  // Note [CPU threads]: BLAS is single-threaded while the pool has threads, so large GEMMs are
  // split here, over batch entries or else over row (or column) blocks of C.
  const int64_t threads = pool_threads();
  if (threads > 1 && g.batch * g.m * g.n * g.k >= kParallelGemmFlops) {
    if (g.batch >= threads) {
      return parallel_for(g.batch, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t bi = b0; bi < b1; ++bi) block(bi, 0, g.m, 0, g.n);
      });
    }
    for (int64_t bi = 0; bi < g.batch; ++bi) {
      if (g.m >= g.n) parallel_for(g.m, 16, [&](int64_t i0, int64_t i1) { block(bi, i0, i1, 0, g.n); });
      else parallel_for(g.n, 16, [&](int64_t j0, int64_t j1) { block(bi, 0, g.m, j0, j1); });
    }
    return;
  }
  for (int64_t bi = 0; bi < g.batch; ++bi) block(bi, 0, g.m, 0, g.n);
}
// bf16/f16: both operands widened exactly to f32, multiplied by sgemm (f32 accumulation, as the
// loops and cuBLAS), rounded back once.
template <class T>
void gemm_half_blas(const Tensor& dst, const Tensor& a, const Tensor& b, const Gemm& g) {
  std::vector<float> ap, bp, c(static_cast<std::size_t>(g.m * g.n));
  T* out = static_cast<T*>(dst.data_ptr());
  const int m = static_cast<int>(g.m), n = static_cast<int>(g.n), k = static_cast<int>(g.k);
  for (int64_t bi = 0; bi < g.batch; ++bi) {
    if (bi == 0 || a.stride(0) != 0) pack<T>(ap, a, bi);
    if (bi == 0 || b.stride(0) != 0) pack<T>(bp, b, bi);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, ap.data(), k, bp.data(), n, 0.0f,
                c.data(), n);
    T* o = out + bi * g.m * g.n;
    for (int64_t i = 0, e = g.m * g.n; i < e; ++i) o[i] = convert<T>(c[i]);
  }
}
#endif

}  // namespace

void CpuBackend::matmul(const Tensor& dst, const Tensor& a, const Tensor& b) {
  const Gemm g{dst.size(0), dst.size(1), a.size(2), dst.size(2)};
  if (dst.numel() == 0) return;
  if (g.k == 0) {
    fill(dst, 0);
    return;
  }
  dispatch_dtype(dst.dtype(), "matmul", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, bool>) {
      FLAME_FAIL("matmul", "not supported for bool tensors");
    } else {
#ifdef FLAME_WITH_CBLAS
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
        if (fits_int(g.m) && fits_int(g.n) && fits_int(g.k)) return gemm_blas<T>(dst, a, b, g);
      }
      if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>) {
        if (fits_int(g.m) && fits_int(g.n) && fits_int(g.k)) return gemm_half_blas<T>(dst, a, b, g);
      }
#endif
      gemm_loops<T>(dst, a, b, g);
    }
  });
}

}  // namespace flame::backend::cpu
