// Column sums of a prompt's causal attention on a CPU, given each query's log-sum-exp.
//
//   out[h, j] = sum_{i >= j} exp(q[h, i] . k[h / G, j])
//
// where the caller has folded the softmax into the operands: q[h, i] = (scale * query_i, -lse_i) and
// k[., j] = (key_j, 1), so every term is exp(scale * q_i . k_j - lse_i) = A[i, j] <= 1 (no overflow,
// no running max). Built and loaded by `cpu_kernels.py`: compiled with -O3 -march=native -ffast-math
// -fopenmp, linked without -ffast-math (which would set flush-to-zero for the whole process); no torch
// headers, so it builds in about a second.
//
// Why a kernel: torch's fused attention computes A @ V, never A^T @ 1, and the only exact route
// through it is a second attention over the transposed problem, which also multiplies by a value
// tensor nobody needs (half its work). Here each thread holds 64 keys (4 AVX-512 vectors, transposed
// into a small block) and streams the queries at or after them, 4 at a time so a key vector loaded
// once feeds 4 FMAs: the work is the QK^T dot products plus one exp per logit.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kLanes = 16;               // floats per 64-byte vector
constexpr int kVectors = 4;              // key vectors per block
constexpr int kBlock = kLanes * kVectors;  // keys per block
constexpr int kRows = 4;                 // queries per inner step

typedef float Vec __attribute__((vector_size(64)));

inline Vec vexp(Vec x) {
  Vec r;
#pragma omp simd
  for (int t = 0; t < kLanes; ++t) r[t] = expf(x[t]);
  return r;
}

// Dot products of `rows` queries (row-major, `dim` floats each) with the block's keys.
template <int R>
inline void dots(const float* q, int64_t dim, const std::vector<Vec>& keys_t, Vec (&s)[R][kVectors]) {
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < kVectors; ++t) s[r][t] = Vec{};
  for (int64_t c = 0; c < dim; ++c) {
    const Vec* kc = &keys_t[c * kVectors];
    for (int r = 0; r < R; ++r) {
      const float a = q[r * dim + c];
      for (int t = 0; t < kVectors; ++t) s[r][t] += a * kc[t];
    }
  }
}

}  // namespace

extern "C" int kvpress_column_sums(const float* queries, const float* keys, float* out, int64_t num_q_heads,
                                   int64_t num_kv_heads, int64_t n, int64_t dim, int num_threads) {
  if (num_q_heads <= 0 || num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0 || n < 0 || dim <= 0) return 1;
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(dynamic, 1) collapse(2) num_threads(num_threads)
  for (int64_t h = 0; h < num_q_heads; ++h) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* q = queries + h * n * dim;
      const float* k = keys + (h / group) * n * dim;
      const int64_t j0 = b * kBlock;
      const int64_t width = std::min<int64_t>(kBlock, n - j0);
      std::vector<Vec> keys_t(dim * kVectors);  // [dim][kVectors], zero past the last key
      for (int64_t c = 0; c < dim; ++c)
        for (int64_t x = 0; x < kBlock; ++x)
          keys_t[c * kVectors + x / kLanes][x % kLanes] = x < width ? k[(j0 + x) * dim + c] : 0.f;
      Vec acc[kVectors] = {};
      int64_t i = j0;
      // Queries inside the block's span see only the keys at or before them.
      for (const int64_t diagonal_end = std::min(n, j0 + kBlock); i < diagonal_end; ++i) {
        Vec s[1][kVectors];
        dots<1>(q + i * dim, dim, keys_t, s);
        for (int t = 0; t < kVectors; ++t) {
          Vec e = vexp(s[0][t]);
          for (int x = 0; x < kLanes; ++x)
            if (j0 + t * kLanes + x > i) e[x] = 0.f;
          acc[t] += e;
        }
      }
      for (; i + kRows <= n; i += kRows) {
        Vec s[kRows][kVectors];
        dots<kRows>(q + i * dim, dim, keys_t, s);
        for (int r = 0; r < kRows; ++r)
          for (int t = 0; t < kVectors; ++t) acc[t] += vexp(s[r][t]);
      }
      for (; i < n; ++i) {
        Vec s[1][kVectors];
        dots<1>(q + i * dim, dim, keys_t, s);
        for (int t = 0; t < kVectors; ++t) acc[t] += vexp(s[0][t]);
      }
      for (int64_t x = 0; x < width; ++x) out[h * n + j0 + x] = acc[x / kLanes][x % kLanes];
    }
  }
  return 0;
}
