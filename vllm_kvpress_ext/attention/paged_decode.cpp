// Decode attention over the ragged per-head paged cache on a CPU: one query token per request, read
// straight from the pages.
//
//   out[b, h * G + g] = sum_t softmax_t(scale * q[b, h * G + g] . k_t) v_t
//
// over the entries of request row rows[b], KV head h: its seq_lens[row, h] global entries on
// block_tables[row, h, :], then, with a ring, ring_lens[row] entries on ring_tables[row, h, :]. A page
// holds page_size keys and then page_size values (kv viewed as [P, 2, page_size, D]).
//
// Why a kernel: torch's path copies every entry of the batch into a dense padded tensor (`gather_paged`)
// and then runs SDPA over the copy, three passes over the cache's bytes where one suffices; a decode
// step is bound by memory traffic, not arithmetic. Here each (request, KV head) is one task: its G
// queries stay in registers/L1 and each page's keys and values are read once, with a running max and
// sum (the online softmax), so nothing of size N is ever written. A head with no entries gives zeros.
// Built with `column_sums.cpp` by `cpu_kernels.py` (same flags, same library).

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int kMaxGroup = 32;
constexpr int kMaxDim = 256;
constexpr int kMaxPage = 256;
// The running max before any entry. Finite on purpose: -ffast-math assumes no infinities, and a
// logit never comes near it, so exp(kNoMax - max) is exactly 0.
constexpr float kNoMax = -1e30f;

struct Segment {
  const int32_t* table;  // page ids of this head, in entry order
  int64_t length;        // entries
};

// Folds one page's `count` entries (keys at `keys`, values at `values`, `dim` floats each) into the
// running max `m`, sum `l` and weighted value sum `acc` of `group` queries.
inline void fold_page(const float* queries, int group, int64_t dim, const float* keys, const float* values,
                      int64_t count, float* m, float* l, float* acc) {
  float scores[kMaxGroup][kMaxPage];
  for (int g = 0; g < group; ++g) {
    const float* q = queries + g * dim;
    float page_max = kNoMax;
    for (int64_t t = 0; t < count; ++t) {
      const float* k = keys + t * dim;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < dim; ++c) s += q[c] * k[c];
      scores[g][t] = s;
      page_max = std::max(page_max, s);
    }
    const float new_max = std::max(m[g], page_max);
    const float rescale = std::exp(m[g] - new_max);  // underflows to 0 on the first page
    float* a = acc + g * dim;
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) a[c] *= rescale;
    float sum = l[g] * rescale;
    for (int64_t t = 0; t < count; ++t) {
      const float p = std::exp(scores[g][t] - new_max);
      sum += p;
      const float* v = values + t * dim;
#pragma omp simd
      for (int64_t c = 0; c < dim; ++c) a[c] += p * v[c];
    }
    m[g] = new_max;
    l[g] = sum;
  }
}

}  // namespace

extern "C" int kvpress_paged_decode(const float* query, const float* kv, const int32_t* block_tables,
                                    int64_t table_stride_row, int64_t table_stride_head, const int32_t* seq_lens,
                                    int64_t lens_stride_row, const int64_t* rows, const int32_t* ring_tables,
                                    int64_t ring_stride_row, int64_t ring_stride_head, const int64_t* ring_lens,
                                    float* out, int64_t batch, int64_t num_q_heads, int64_t num_kv_heads,
                                    int64_t page_size, int64_t dim, float scale, int num_threads) {
  if (batch < 0 || num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0) return 1;
  const int64_t group = num_q_heads / num_kv_heads;
  if (group > kMaxGroup || dim <= 0 || dim > kMaxDim || page_size <= 0 || page_size > kMaxPage) return 2;
#pragma omp parallel for schedule(dynamic, 1) collapse(2) num_threads(num_threads)
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t row = rows[b];
      float queries[kMaxGroup * kMaxDim];
      float acc[kMaxGroup * kMaxDim];
      float m[kMaxGroup], l[kMaxGroup];
      const float* q_in = query + (b * num_q_heads + h * group) * dim;
      for (int64_t i = 0; i < group * dim; ++i) {
        queries[i] = q_in[i] * scale;
        acc[i] = 0.f;
      }
      for (int g = 0; g < group; ++g) {
        m[g] = kNoMax;
        l[g] = 0.f;
      }
      const Segment segments[2] = {
          {block_tables + row * table_stride_row + h * table_stride_head, seq_lens[row * lens_stride_row + h]},
          {ring_tables != nullptr ? ring_tables + row * ring_stride_row + h * ring_stride_head : nullptr,
           ring_tables != nullptr ? ring_lens[row] : 0},
      };
      for (const Segment& segment : segments) {
        for (int64_t start = 0; start < segment.length; start += page_size) {
          const int64_t page = segment.table[start / page_size];
          const float* keys = kv + page * 2 * page_size * dim;
          const int64_t count = std::min(page_size, segment.length - start);
          fold_page(queries, static_cast<int>(group), dim, keys, keys + page_size * dim, count, m, l, acc);
        }
      }
      float* o = out + (b * num_q_heads + h * group) * dim;
      for (int64_t g = 0; g < group; ++g) {
        const float inverse = l[g] > 0.f ? 1.f / l[g] : 0.f;  // no entries: zeros, as torch's path gives
        for (int64_t c = 0; c < dim; ++c) o[g * dim + c] = acc[g * dim + c] * inverse;
      }
    }
  }
  return 0;
}
