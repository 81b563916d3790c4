#!/usr/bin/env python3
"""A NumPy model of FLAME's short-sequence attention kernels (src/backend/cuda/attention/sdpa_short.cu,
Note [Short-sequence attention]) at the level of warp fragments, checked against plain attention.

The three kernels (forward, dQ, dK/dV) are transcribed here step by step, with the lanes of a warp as
arrays, on top of models of the two PTX instructions they are built from, written from the PTX ISA's
fragment layouts:
  - mma.sync.aligned.m16n8k16.row.col: lane l (g = l / 4, c = l % 4) holds A[g][2c..2c+1],
    A[g+8][2c..], A[g][2c+8..], A[g+8][2c+8..] in its four registers, B[2c..2c+1][g] and
    B[2c+8..][g] in its two, and C/D[g][2c..2c+1], C/D[g+8][2c..];
  - ldmatrix.sync.aligned.m8n8.x4[.trans]: lane l gives the address of row l % 8 of matrix l / 8 and
    receives (row l / 4, cols 2(l % 4), 2(l % 4) + 1) of each matrix, or with .trans
    (rows 2(l % 4), 2(l % 4) + 1, col l / 4);
and the kernels' swizzled shared-memory layout. What it checks: the kernels' index arithmetic
(fragment addresses, the swizzle, the C-to-A reuse of P and dS, padding and masking, the online
softmax, the logsumexp and D = rowsum(dO * O) bookkeeping, the gradients' column sums) gives
attention's forward, its three gradients and their column sums, in float64, to rounding error; and that every ldmatrix phase reads distinct banks. What it
cannot check: the hardware itself (it models the PTX documentation), races, or performance; the GPU
tests (tests/test_sdpa_short.cpp) do that. It must be changed with the kernels.

Exit status 0 when every case matches, 1 otherwise, 77 when NumPy is missing (ctest: skipped).
"""
import sys

try:
    import numpy as np
except ImportError:
    print("sdpa_short_model: NumPy is not installed; skipped")
    sys.exit(77)

D = 64          # head dim (kD)
ROW = 64        # shared-memory row stride in halves (kRow)
CHUNK = 64      # keys or queries per softmax step (kChunk)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
LANES = np.arange(32)
G, C = LANES // 4, LANES % 4


def swz(r, col):
    """The kernels' swz(): chunk col / 8 of row r is stored at chunk (col / 8) ^ (r % 8)."""
    return r * ROW + ((((col >> 3) ^ (r & 7)) << 3) | (col & 7))


# ---- the two PTX instructions ----

def ldsm4(sm, addr, trans):
    """ldmatrix .x4 [.trans]: addr(l) is lane l's row address (row l % 8 of matrix l / 8)."""
    out = np.zeros((32, 4, 2))
    for m in range(4):
        rows = []
        for r in range(8):
            a = addr(8 * m + r)
            assert a % 8 == 0, "ldmatrix rows are 16-byte aligned"
            rows.append(sm[a:a + 8])
        M = np.array(rows)
        for l in range(32):
            if trans:
                out[l, m] = [M[2 * (l % 4)][l // 4], M[2 * (l % 4) + 1][l // 4]]
            else:
                out[l, m] = [M[l // 4][2 * (l % 4)], M[l // 4][2 * (l % 4) + 1]]
    return out


def mma(c, a, b0, b1):
    """mma m16n8k16 row.col: c [32][4] += A (a [32][4][2]) . B (b0, b1 [32][2])."""
    A = np.zeros((16, 16)); B = np.zeros((16, 8)); Cm = np.zeros((16, 8))
    for l in range(32):
        g, t = l // 4, l % 4
        A[g, 2 * t:2 * t + 2] = a[l][0]; A[g + 8, 2 * t:2 * t + 2] = a[l][1]
        A[g, 2 * t + 8:2 * t + 10] = a[l][2]; A[g + 8, 2 * t + 8:2 * t + 10] = a[l][3]
        B[2 * t:2 * t + 2, g] = b0[l]; B[2 * t + 8:2 * t + 10, g] = b1[l]
        Cm[g, 2 * t:2 * t + 2] = c[l][0:2]; Cm[g + 8, 2 * t:2 * t + 2] = c[l][2:4]
    Cm = Cm + A @ B
    for l in range(32):
        g, t = l // 4, l % 4
        c[l][0:2] = Cm[g, 2 * t:2 * t + 2]; c[l][2:4] = Cm[g + 8, 2 * t:2 * t + 2]


# ---- the kernels' helpers ----

def stage(X, rows):
    """stage(): rows of X into swizzled shared memory, rows past X zero."""
    sm = np.zeros(rows * ROW)
    for r in range(min(rows, X.shape[0])):
        for c in range(0, D, 8):
            sm[swz(r, c):swz(r, c) + 8] = X[r, c:c + 8]
    return sm


def load_a(X, r0):
    """load_a(): A fragments of rows r0..r0+15 over the 64 dims (four k-steps); rows past X zero."""
    a = np.zeros((4, 32, 4, 2))
    n = X.shape[0]
    get = lambda r, col: X[r, col:col + 2] if r < n else np.zeros(2)
    for l in range(32):
        g, c = l // 4, l % 4
        for ks in range(4):
            col = ks * 16 + 2 * c
            a[ks][l] = [get(r0 + g, col), get(r0 + g + 8, col), get(r0 + g, col + 8), get(r0 + g + 8, col + 8)]
    return a


def mma_abt(acc, a, sm, n0, ncols):
    """mma_abt(): acc (16 x 64, C layout) += A . B^T, B's rows n0.. in shared memory."""
    for p in range(4):
        if n0 + p * 16 >= ncols:
            break
        for ks in range(4):
            r = ldsm4(sm, lambda l: swz(n0 + p * 16 + ((l // 8) // 2) * 8 + l % 8, ks * 16 + ((l // 8) % 2) * 8), False)
            mma(acc[2 * p], a[ks], r[:, 0], r[:, 1])
            mma(acc[2 * p + 1], a[ks], r[:, 2], r[:, 3])


def mma_pb(acc, p, sm, k0, nrows):
    """mma_pb(): acc (16 x 64) += P (C layout, reused as A) . B, B's rows k0.. in shared memory."""
    for kt in range(4):
        if k0 + kt * 16 >= nrows:
            break
        a = np.zeros((32, 4, 2))
        a[:, 0] = p[2 * kt][:, 0:2]; a[:, 1] = p[2 * kt][:, 2:4]
        a[:, 2] = p[2 * kt + 1][:, 0:2]; a[:, 3] = p[2 * kt + 1][:, 2:4]
        for dp in range(4):
            r = ldsm4(sm, lambda l: swz(k0 + kt * 16 + ((l // 8) % 2) * 8 + l % 8, dp * 16 + ((l // 8) // 2) * 8), True)
            mma(acc[2 * dp], a, r[:, 0], r[:, 1])
            mma(acc[2 * dp + 1], a, r[:, 2], r[:, 3])


def quad(x, op):
    """quad_max / quad_sum: over the four lanes of a row group (shfl_xor 1, 2)."""
    return np.repeat(op(x.reshape(8, 4), axis=1), 4)


def store_rows(dst, r0, n, acc, mul_lo, mul_hi):
    for j in range(8):
        for l in range(32):
            g, c = l // 4, l % 4
            col = j * 8 + 2 * c
            if r0 + g < n:
                dst[r0 + g, col:col + 2] = acc[j][l][0:2] * mul_lo[l]
            if r0 + g + 8 < n:
                dst[r0 + g + 8, col:col + 2] = acc[j][l][2:4] * mul_hi[l]


def add_column_sums(sums, acc, mul, r0, n):
    """add_column_sums(): per column pair c, the sum over the eight row groups (shfl_xor 4, 8, 16)
    of the rows below n, added by lanes 0..3."""
    for j in range(8):
        for e in range(2):
            v = np.array([(acc[j][l][e] if r0 + l // 4 < n else 0.0) + (acc[j][l][2 + e] if r0 + l // 4 + 8 < n else 0.0)
                          for l in range(32)])
            for x in (4, 8, 16):
                v = v + v[LANES ^ x]
            for l in range(4):
                sums[j * 8 + 2 * l + e] += v[l] * mul


def pad16(n):
    return (n + 15) // 16 * 16


# ---- the kernels (one head; the warps' tiles in turn) ----

def forward(Q, K, V, scale):
    L, S = Q.shape[0], K.shape[0]
    spad = pad16(S)
    ks, vs = stage(K, spad), stage(V, spad)
    out, stats = np.full((L, D), np.nan), np.full(L, np.nan)
    sl2 = scale * LOG2E
    for r0 in range(0, pad16(L), 16):
        qa = load_a(Q, r0)
        o = np.zeros((8, 32, 4))
        m_lo, m_hi = np.full(32, -np.inf), np.full(32, -np.inf)
        l_lo, l_hi = np.zeros(32), np.zeros(32)
        for k0 in range(0, spad, CHUNK):
            s = np.zeros((8, 32, 4))
            mma_abt(s, qa, ks, k0, spad)
            mx_lo, mx_hi = np.full(32, -np.inf), np.full(32, -np.inf)
            for j in range(8):
                for e in range(2):
                    valid = k0 + j * 8 + 2 * C + e < S
                    s[j][:, e] = np.where(valid, s[j][:, e] * sl2, -np.inf)
                    s[j][:, 2 + e] = np.where(valid, s[j][:, 2 + e] * sl2, -np.inf)
                    mx_lo = np.maximum(mx_lo, s[j][:, e]); mx_hi = np.maximum(mx_hi, s[j][:, 2 + e])
            mn_lo, mn_hi = np.maximum(m_lo, quad(mx_lo, np.max)), np.maximum(m_hi, quad(mx_hi, np.max))
            al_lo, al_hi = np.exp2(m_lo - mn_lo), np.exp2(m_hi - mn_hi)
            m_lo, m_hi = mn_lo, mn_hi
            sum_lo, sum_hi = np.zeros(32), np.zeros(32)
            for j in range(8):
                for e in range(2):
                    s[j][:, e] = np.exp2(s[j][:, e] - mn_lo); s[j][:, 2 + e] = np.exp2(s[j][:, 2 + e] - mn_hi)
                    sum_lo += s[j][:, e]; sum_hi += s[j][:, 2 + e]
                o[j][:, 0:2] *= al_lo[:, None]; o[j][:, 2:4] *= al_hi[:, None]
            l_lo, l_hi = l_lo * al_lo + sum_lo, l_hi * al_hi + sum_hi
            mma_pb(o, s, vs, k0, spad)
        l_lo, l_hi = quad(l_lo, np.sum), quad(l_hi, np.sum)
        store_rows(out, r0, L, o, 1 / l_lo, 1 / l_hi)
        for g in range(8):
            if r0 + g < L:
                stats[r0 + g] = m_lo[4 * g] * LN2 + np.log(l_lo[4 * g])
            if r0 + g + 8 < L:
                stats[r0 + g + 8] = m_hi[4 * g] * LN2 + np.log(l_hi[4 * g])
    return out, stats


def backward_dq(Q, K, V, O, dO, stats, scale):
    L, S = Q.shape[0], K.shape[0]
    spad = pad16(S)
    ks, vs = stage(K, spad), stage(V, spad)
    dQ = np.full((L, D), np.nan)
    drow = np.full(L, np.nan)  # D per query row, written for the dK/dV kernel
    sums = np.zeros(D)
    sl2 = scale * LOG2E
    for r0 in range(0, pad16(L), 16):
        qa, da, oa = load_a(Q, r0), load_a(dO, r0), load_a(O, r0)
        d_lo, d_hi = np.zeros(32), np.zeros(32)
        for k2 in range(4):
            for i in range(4):
                d = (da[k2][:, i] * oa[k2][:, i]).sum(axis=1)
                if i % 2 == 0:
                    d_lo += d
                else:
                    d_hi += d
        d_lo, d_hi = quad(d_lo, np.sum), quad(d_hi, np.sum)
        for g in range(8):  # lanes with c == 0
            if r0 + g < L:
                drow[r0 + g] = d_lo[4 * g]
            if r0 + g + 8 < L:
                drow[r0 + g + 8] = d_hi[4 * g]
        lse_lo = np.array([stats[r0 + g] * LOG2E if r0 + g < L else np.inf for g in G])
        lse_hi = np.array([stats[r0 + g + 8] * LOG2E if r0 + g + 8 < L else np.inf for g in G])
        dq = np.zeros((8, 32, 4))
        for k0 in range(0, spad, CHUNK):
            s, dp = np.zeros((8, 32, 4)), np.zeros((8, 32, 4))
            mma_abt(s, qa, ks, k0, spad)
            mma_abt(dp, da, vs, k0, spad)
            for j in range(8):
                for e in range(2):
                    valid = k0 + j * 8 + 2 * C + e < S
                    p_lo = np.where(valid, np.exp2(s[j][:, e] * sl2 - lse_lo), 0.0)
                    p_hi = np.where(valid, np.exp2(s[j][:, 2 + e] * sl2 - lse_hi), 0.0)
                    s[j][:, e] = p_lo * (dp[j][:, e] - d_lo)
                    s[j][:, 2 + e] = p_hi * (dp[j][:, 2 + e] - d_hi)
            mma_pb(dq, s, ks, k0, spad)
        store_rows(dQ, r0, L, dq, np.full(32, scale), np.full(32, scale))
        add_column_sums(sums, dq, scale, r0, L)
    return dQ, sums, drow


def backward_dkv(Q, K, V, dO, stats, drow, scale):
    L, S = Q.shape[0], K.shape[0]
    lpad = pad16(L)
    qs, dos = stage(Q, lpad), stage(dO, lpad)
    lse = np.array([stats[r] * LOG2E if r < L else np.inf for r in range(lpad)])
    dd = np.array([drow[r] if r < L else 0.0 for r in range(lpad)])
    dK, dV = np.full((S, D), np.nan), np.full((S, D), np.nan)
    sums = np.zeros(2 * D)
    sl2 = scale * LOG2E
    for r0 in range(0, pad16(S), 16):
        ka, va = load_a(K, r0), load_a(V, r0)
        dk, dv = np.zeros((8, 32, 4)), np.zeros((8, 32, 4))
        for q0 in range(0, lpad, CHUNK):
            s, dp = np.zeros((8, 32, 4)), np.zeros((8, 32, 4))  # rows keys, columns queries
            mma_abt(s, ka, qs, q0, lpad)
            mma_abt(dp, va, dos, q0, lpad)
            for j in range(8):
                for e in range(2):
                    col = q0 + j * 8 + 2 * C + e
                    lq = np.array([lse[x] if x < lpad else np.inf for x in col])
                    dc = np.array([dd[x] if x < lpad else 0.0 for x in col])
                    with np.errstate(over="ignore", invalid="ignore"):  # padded keys: rows not stored
                        p_lo, p_hi = np.exp2(s[j][:, e] * sl2 - lq), np.exp2(s[j][:, 2 + e] * sl2 - lq)
                        s[j][:, e], s[j][:, 2 + e] = p_lo, p_hi
                        dp[j][:, e] = p_lo * (dp[j][:, e] - dc)
                        dp[j][:, 2 + e] = p_hi * (dp[j][:, 2 + e] - dc)
            mma_pb(dv, s, dos, q0, lpad)
            mma_pb(dk, dp, qs, q0, lpad)
        store_rows(dK, r0, S, dk, np.full(32, scale), np.full(32, scale))
        store_rows(dV, r0, S, dv, np.ones(32), np.ones(32))
        add_column_sums(sums[:D], dk, scale, r0, S)
        add_column_sums(sums[D:], dv, 1.0, r0, S)
    return dK, dV, sums


def reference(Q, K, V, dO, scale):
    Sc = Q @ K.T * scale
    m = Sc.max(axis=1, keepdims=True)
    P = np.exp(Sc - m)
    l = P.sum(axis=1, keepdims=True)
    P /= l
    O = P @ V
    dP = dO @ V.T
    dS = P * (dP - (dO * O).sum(axis=1, keepdims=True))
    return O, (m + np.log(l))[:, 0], dS @ K * scale, dS.T @ Q * scale, P.T @ dO


def main():
    ok = True
    # Every ldmatrix phase reads one logical chunk of eight consecutive rows: distinct banks.
    for base in range(0, 256, 8):
        for cc in range(8):
            ok &= len({(swz(base + i, cc * 8) * 2 // 16) % 8 for i in range(8)}) == 8
    print("ldmatrix phases conflict-free:", ok)
    rng = np.random.default_rng(1)
    for L, S, sd in [(40, 77, 1.0), (1, 5, 1.0), (17, 16, 3.0), (65, 63, 2.0), (196, 196, 1.0), (100, 37, 3.0),
                     (256, 250, 1.0)]:
        Q, K = rng.standard_normal((L, D)) * sd, rng.standard_normal((S, D)) * sd
        V, dO = rng.standard_normal((S, D)), rng.standard_normal((L, D))
        scale = D ** -0.5
        O, lse = forward(Q, K, V, scale)
        dQ, sq, drow = backward_dq(Q, K, V, O, dO, lse, scale)
        dK, dV, skv = backward_dkv(Q, K, V, dO, lse, drow, scale)
        want = reference(Q, K, V, dO, scale)
        want = want + (np.concatenate([want[2].sum(axis=0), want[3].sum(axis=0), want[4].sum(axis=0)]),)
        errs = [np.abs(a - b).max() / max(1.0, np.abs(b).max())
                for a, b in zip((O, lse, dQ, dK, dV, np.concatenate([sq, skv])), want)]
        good = all(e < 1e-12 for e in errs)  # NaN (an element never written) fails too
        ok &= good
        print(f"L {L:3d} S {S:3d} scale of q, k {sd}: max rel. error out {errs[0]:.1e} lse {errs[1]:.1e} "
              f"dq {errs[2]:.1e} dk {errs[3]:.1e} dv {errs[4]:.1e} column sums {errs[5]:.1e}"
              f"{'' if good else '  MISMATCH'}")
    print("sdpa_short_model:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
