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
// queries stay in L1 and each page's keys and values are read once, with a running max and sum (the
// online softmax) over blocks of up to 256 entries, so nothing of size N is ever written. A head with
// no entries gives zeros.
//
// Where the time went, and what each choice below bought, on the development machine's AMD EPYC (16
// requests x 3 KV heads x 540 entries x 30 layers, pages shuffled over a 52,000-page pool): the first
// version folded one page at a time, its dot products one chain of dependent adds per key and its
// value sums updated in memory per entry, 10.6 ms a step with the pages in cache and 34 ms from
// memory. Four keys scored at a time, 64 value columns held in registers over a page, the
// exponentials of a whole block in one vectorised pass, and the pages four ahead prefetched (the
// hardware prefetcher cannot guess the next page of a head): 8.2 and 28 ms. Then the queries of a head taken up
// to four at a time, so that each key and value is loaded once for all of them, not once per query: on a Xeon
// with AVX-512 (16 requests x 3 KV heads of 3 queries x 560 entries x 30 layers, 2 threads), 15.0 -> 12.6 ms a
// step with the pages in cache and 30.7 -> 28.7 ms from memory; 4 queries of 256 columns (Gemma 3's shape, pages
// mostly in cache) 29.8 -> 21.0 ms; one query (no grouping) unchanged.
// Built with `column_sums.cpp` by `cpu_kernels.py` (same flags, same library).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int kMaxGroup = 32;
constexpr int kMaxDim = 256;
constexpr int kMaxPage = 256;
// Entries folded into the running softmax at a time: scores for a block of pages first, then one
// rescale and one vectorised pass of exponentials for the block, then its values.
constexpr int kBlockEntries = 256;
// Pages ahead whose bytes are prefetched while a page is scored: the pages of a head are scattered
// over the pool, so the hardware prefetcher, which follows addresses, cannot see the next one.
constexpr int kPrefetchPages = 4;
// The running max before any entry. Finite on purpose: -ffast-math assumes no infinities, and a
// logit never comes near it, so exp(kNoMax - max) is exactly 0.
constexpr float kNoMax = -1e30f;

struct Segment {
  const int32_t* table;  // page ids of this head, in entry order
  int64_t length;        // entries
};

// The queries of a KV head (its group) handled together: every key and value of a page is loaded once for up to
// this many of them, where one query at a time loaded each entry `group` times.
constexpr int kQueriesAtOnce = 4;

// q . k for the `n` keys from `keys` (`dim` floats each) and the Q queries from `queries` (`dim` floats each), into
// `scores` (Q rows, kBlockEntries apart). Four keys at a time: each dot product is a chain of dependent adds, so
// 4 x Q independent chains keep the vector units busy.
template <int Q>
inline void score_keys(const float* __restrict__ queries, const float* __restrict__ keys, int64_t n, int64_t dim,
                       float* __restrict__ scores) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const float* k = keys + t * dim;
    float s[4 * Q] = {};
#pragma omp simd reduction(+ : s[:4 * Q])
    for (int64_t c = 0; c < dim; ++c) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const float x = k[j * dim + c];
#pragma GCC unroll 4
        for (int g = 0; g < Q; ++g) s[j * Q + g] += queries[g * dim + c] * x;
      }
    }
    for (int j = 0; j < 4; ++j)
      for (int g = 0; g < Q; ++g) scores[g * kBlockEntries + t + j] = s[j * Q + g];
  }
  for (; t < n; ++t) {
    const float* k = keys + t * dim;
    float s[Q] = {};
#pragma omp simd reduction(+ : s[:Q])
    for (int64_t c = 0; c < dim; ++c) {
#pragma GCC unroll 4
      for (int g = 0; g < Q; ++g) s[g] += queries[g * dim + c] * k[c];
    }
    for (int g = 0; g < Q; ++g) scores[g * kBlockEntries + t] = s[g];
  }
}

// acc[g] += sum_t weights[g][t] * values[t] for the Q queries, over `n` values of `dim` floats (`weights`: Q rows
// kBlockEntries apart; `acc`: Q rows of `dim`). A band of columns at a time, held in registers across the whole
// page for all Q queries (64 columns for up to two queries, 32 past that, so they fit the register file), where
// updating `acc` in memory per value would chain every add through a store and a load.
template <int Q>
inline void accumulate_values(const float* __restrict__ weights, const float* __restrict__ values, int64_t n,
                              int64_t dim, float* __restrict__ acc) {
  constexpr int64_t kWidth = Q <= 2 ? 64 : 32;
  int64_t c0 = 0;
  for (; c0 + kWidth <= dim; c0 += kWidth) {
    float r[Q][kWidth];
    for (int g = 0; g < Q; ++g) {
#pragma omp simd
      for (int64_t c = 0; c < kWidth; ++c) r[g][c] = acc[g * dim + c0 + c];
    }
    for (int64_t t = 0; t < n; ++t) {
      const float* v = values + t * dim + c0;
#pragma GCC unroll 4
      for (int g = 0; g < Q; ++g) {
        const float w = weights[g * kBlockEntries + t];
#pragma omp simd
        for (int64_t c = 0; c < kWidth; ++c) r[g][c] += w * v[c];
      }
    }
    for (int g = 0; g < Q; ++g) {
#pragma omp simd
      for (int64_t c = 0; c < kWidth; ++c) acc[g * dim + c0 + c] = r[g][c];
    }
  }
  for (int64_t t = 0; t < n; ++t) {  // the columns past the last whole band, if any
    const float* v = values + t * dim;
    for (int g = 0; g < Q; ++g) {
      const float w = weights[g * kBlockEntries + t];
#pragma omp simd
      for (int64_t c = c0; c < dim; ++c) acc[g * dim + c] += w * v[c];
    }
  }
}

// Calls body(first, count) for the group's queries kQueriesAtOnce at a time, `count` a compile-time constant
// (std::integral_constant) so that each pass's loops are unrolled for its number of queries.
template <typename Body>
inline void for_query_batches(int group, Body&& body) {
  for (int first = 0; first < group; first += kQueriesAtOnce) {
    switch (std::min(kQueriesAtOnce, group - first)) {
      case 1: body(first, std::integral_constant<int, 1>{}); break;
      case 2: body(first, std::integral_constant<int, 2>{}); break;
      case 3: body(first, std::integral_constant<int, 3>{}); break;
      default: body(first, std::integral_constant<int, kQueriesAtOnce>{}); break;
    }
  }
}

// Folds one block of entries, `count` of them from entry `first` of `segment` (whole pages but perhaps
// the last), into the running max `m`, sum `l` and weighted value sum `acc` of `group` queries: every
// score of the block first, then one rescale and one vectorised pass of exponentials, then the values.
inline void fold_block(const float* kv, const Segment& segment, int64_t first, int64_t count, int64_t page_size,
                       int64_t dim, const float* queries, int group, float* m, float* l, float* acc) {
  float scores[kMaxGroup][kBlockEntries];
  const int64_t page_floats = 2 * page_size * dim;
  const int64_t num_pages = (segment.length + page_size - 1) / page_size;
  for (int64_t done = 0; done < count; done += page_size) {
    const int64_t page_index = (first + done) / page_size;
    if (page_index + kPrefetchPages < num_pages) {
      const char* ahead = reinterpret_cast<const char*>(kv + segment.table[page_index + kPrefetchPages] * page_floats);
      for (int64_t byte = 0; byte < page_floats * 4; byte += 64) __builtin_prefetch(ahead + byte);
    }
    const float* keys = kv + segment.table[page_index] * page_floats;
    const int64_t n = std::min(page_size, count - done);
    for_query_batches(group, [&](int g, auto count) {
      score_keys<decltype(count)::value>(queries + g * dim, keys, n, dim, scores[g] + done);
    });
  }
  for (int g = 0; g < group; ++g) {
    float* row = scores[g];
    float block_max = kNoMax;
#pragma omp simd reduction(max : block_max)
    for (int64_t t = 0; t < count; ++t) block_max = std::max(block_max, row[t]);
    const float new_max = std::max(m[g], block_max);
    const float rescale = std::exp(m[g] - new_max);  // underflows to 0 on the first block
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < count; ++t) {
      row[t] = std::exp(row[t] - new_max);
      sum += row[t];
    }
    float* a = acc + g * dim;
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) a[c] *= rescale;
    m[g] = new_max;
    l[g] = l[g] * rescale + sum;
  }
  for (int64_t done = 0; done < count; done += page_size) {
    const float* values = kv + segment.table[(first + done) / page_size] * page_floats + page_size * dim;
    const int64_t n = std::min(page_size, count - done);
    for_query_batches(group, [&](int g, auto count) {
      accumulate_values<decltype(count)::value>(scores[g] + done, values, n, dim, acc + g * dim);
    });
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
      const int64_t block = std::max<int64_t>(1, kBlockEntries / page_size) * page_size;
      for (const Segment& segment : segments) {
        for (int64_t first = 0; first < segment.length; first += block) {
          fold_block(kv, segment, first, std::min(block, segment.length - first), page_size, dim, queries,
                     static_cast<int>(group), m, l, acc);
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
