// Ragged per-head paged decode attention, CUDA, split-K.
//
// Must match vllm_kvpress_ext.attention.reference.paged_decode_attention (without probs_out) and the
// Triton kernel in kernels/decode_attention.py; see those for the data layout. In short: one query
// per request; each (cache row, KV head) is its own sequence of seq_lens[row, h] entries whose pages
// are block_tables[row, h, :], plus, with a ring, ring_lens[row] slots on ring_tables[row, h, :];
// kv is [P, 2, page_size, D] (key of slot (p, o) = row p * 2 * page_size + o of the [*, D] view, value
// page_size rows further). The GQA group's query heads share every K/V load.
//
// Grid of the split kernel: (num_splits, Hkv, B), kNumWarps warps per block. Block (s, h, b) covers
// tokens [s * split_tokens, (s + 1) * split_tokens) of head h of request b. Each warp takes every
// kNumWarps-th token; a lane holds HEAD_DIM / 32 contiguous dimensions of K, V, the group's queries
// and the accumulators, so a dot product is a per-lane partial sum plus a butterfly reduction. Each
// warp keeps its own online softmax (base 2, fp32); the warps are merged through shared memory and
// the block writes one partial (max, sum, acc) per query head. The reduce kernel (grid (Hq, B),
// HEAD_DIM threads) merges the splits and writes the output in the input dtype.
//
// Splits let a long head spread over many SMs while short heads finish early (their blocks past the
// head's end write an empty partial and exit). Deliberately simple: no vectorised 16-byte loads, no
// K/V prefetch through shared memory; see csrc/README.md for what was and was not measured.
#include "paged_decode.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

namespace kvpress {
namespace {

constexpr int kWarpSize = 32;
constexpr int kNumWarps = 4;
constexpr float kLog2e = 1.4426950408889634f;

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float to_float<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

// Row of token t's key in kv viewed as [P * 2 * page_size, D]: global entry t, or ring slot t - glen.
__device__ __forceinline__ int64_t key_row(const PagedDecodeParams& p, int64_t row, int h, int t, int glen) {
  int page;
  int offset;
  if (t < glen) {
    page = p.block_tables[row * p.table_stride_r + h * p.table_stride_h + t / p.page_size];
    offset = t % p.page_size;
  } else {
    const int rt = t - glen;
    page = p.ring_tables[row * p.ring_stride_r + h * p.ring_stride_h + rt / p.page_size];
    offset = rt % p.page_size;
  }
  // 64-bit before the multiply: pools past 2^31 elements are ordinary on large GPUs.
  return static_cast<int64_t>(page) * 2 * p.page_size + offset;
}

template <typename T, int HEAD_DIM, int MAX_GROUP>
__global__ void __launch_bounds__(kNumWarps * kWarpSize) paged_decode_split_kernel(const PagedDecodeParams p) {
  constexpr int kPerLane = HEAD_DIM / kWarpSize;
  const int split = blockIdx.x;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int64_t row = p.rows[b];
  const int glen = p.seq_lens[row * p.lens_stride_r + h * p.lens_stride_h];
  const int rlen = p.ring_lens != nullptr ? static_cast<int>(p.ring_lens[row * p.ring_lens_stride]) : 0;
  const int start = split * p.split_tokens;
  const int end = min(start + p.split_tokens, glen + rlen);
  const T* query = static_cast<const T*>(p.query);
  const T* kv = static_cast<const T*>(p.kv);
  const float scale = p.scale * kLog2e;  // scores in base 2: exp2f is one instruction

  float q[MAX_GROUP][kPerLane];
  float acc[MAX_GROUP][kPerLane];
  float run_max[MAX_GROUP];
  float run_sum[MAX_GROUP];
#pragma unroll
  for (int g = 0; g < MAX_GROUP; ++g) {
    run_max[g] = -CUDART_INF_F;
    run_sum[g] = 0.f;
    const int64_t q_off = b * p.query_stride_b + static_cast<int64_t>(h * group + g) * p.query_stride_h;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      q[g][i] = g < group ? to_float(query[q_off + lane * kPerLane + i]) * scale : 0.f;
      acc[g][i] = 0.f;
    }
  }

  for (int t = start + warp; t < end; t += kNumWarps) {
    const int64_t k_off = key_row(p, row, h, t, glen) * HEAD_DIM + lane * kPerLane;
    const int64_t v_off = k_off + static_cast<int64_t>(p.page_size) * HEAD_DIM;
    float k[kPerLane];
    float v[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      k[i] = to_float(kv[k_off + i]);
      v[i] = to_float(kv[v_off + i]);
    }
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) {
      if (g < group) {  // uniform across the block: no divergence around the shuffles
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          s += q[g][i] * k[i];
        }
        s = warp_sum(s);
        const float m_new = fmaxf(run_max[g], s);
        const float alpha = exp2f(run_max[g] - m_new);  // 0 on the first token (max was -inf)
        const float prob = exp2f(s - m_new);
        run_sum[g] = run_sum[g] * alpha + prob;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          acc[g][i] = acc[g][i] * alpha + prob * v[i];
        }
        run_max[g] = m_new;
      }
    }
  }

  // Merge the warps' softmax states, then write this split's partial for every query head of the group.
  __shared__ float s_max[kNumWarps][MAX_GROUP];
  __shared__ float s_sum[kNumWarps][MAX_GROUP];
  __shared__ float s_acc[kNumWarps][MAX_GROUP][HEAD_DIM];
#pragma unroll
  for (int g = 0; g < MAX_GROUP; ++g) {
    if (lane == 0) {
      s_max[warp][g] = run_max[g];
      s_sum[warp][g] = run_sum[g];
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      s_acc[warp][g][lane * kPerLane + i] = acc[g][i];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < group * HEAD_DIM; idx += blockDim.x) {
    const int g = idx / HEAD_DIM;
    const int d = idx % HEAD_DIM;
    float m = -CUDART_INF_F;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) {
      m = fmaxf(m, s_max[w][g]);
    }
    float sum = 0.f;
    float a = 0.f;
    if (m != -CUDART_INF_F) {  // an empty split stays (-inf, 0, 0)
#pragma unroll
      for (int w = 0; w < kNumWarps; ++w) {
        const float weight = exp2f(s_max[w][g] - m);
        sum += s_sum[w][g] * weight;
        a += s_acc[w][g][d] * weight;
      }
    }
    const int64_t part = (static_cast<int64_t>(b) * p.num_q_heads + h * group + g) * p.num_splits + split;
    if (d == 0) {
      p.partial_max[part] = m;
      p.partial_sum[part] = sum;
    }
    p.partial_acc[part * HEAD_DIM + d] = a;
  }
}

template <typename T>
__global__ void paged_decode_reduce_kernel(const PagedDecodeParams p) {
  const int hq = blockIdx.x;
  const int b = blockIdx.y;
  const int64_t base = (static_cast<int64_t>(b) * p.num_q_heads + hq) * p.num_splits;
  float m = -CUDART_INF_F;
  for (int s = 0; s < p.num_splits; ++s) {
    m = fmaxf(m, p.partial_max[base + s]);
  }
  T* out = static_cast<T*>(p.out);
  for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
    float sum = 0.f;
    float a = 0.f;
    if (m != -CUDART_INF_F) {
      for (int s = 0; s < p.num_splits; ++s) {
        const float weight = exp2f(p.partial_max[base + s] - m);
        sum += p.partial_sum[base + s] * weight;
        a += p.partial_acc[(base + s) * p.head_dim + d] * weight;
      }
    }
    // A head with nothing to attend to yields zeros, as the reference does.
    out[(static_cast<int64_t>(b) * p.num_q_heads + hq) * p.head_dim + d] = from_float<T>(sum > 0.f ? a / sum : 0.f);
  }
}

template <typename T, int HEAD_DIM, int MAX_GROUP>
cudaError_t launch(const PagedDecodeParams& p, cudaStream_t stream) {
  const dim3 split_grid(p.num_splits, p.num_kv_heads, p.batch);
  paged_decode_split_kernel<T, HEAD_DIM, MAX_GROUP><<<split_grid, kNumWarps * kWarpSize, 0, stream>>>(p);
  const dim3 reduce_grid(p.num_q_heads, p.batch);
  paged_decode_reduce_kernel<T><<<reduce_grid, HEAD_DIM, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int HEAD_DIM>
cudaError_t dispatch_group(const PagedDecodeParams& p, cudaStream_t stream) {
  const int group = p.num_q_heads / p.num_kv_heads;
  if (group <= 1) return launch<T, HEAD_DIM, 1>(p, stream);
  if (group <= 2) return launch<T, HEAD_DIM, 2>(p, stream);
  if (group <= 4) return launch<T, HEAD_DIM, 4>(p, stream);
  if (group <= 8) return launch<T, HEAD_DIM, 8>(p, stream);
  if (group <= 16) return launch<T, HEAD_DIM, 16>(p, stream);
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t dispatch_head_dim(const PagedDecodeParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64:
      return dispatch_group<T, 64>(p, stream);
    case 128:
      return dispatch_group<T, 128>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t paged_decode(const PagedDecodeParams& params, cudaStream_t stream) {
  if (params.num_kv_heads <= 0 || params.num_q_heads % params.num_kv_heads != 0 || params.num_splits < 1 ||
      params.split_tokens < 1 || params.page_size < 1) {
    return cudaErrorInvalidValue;
  }
  if (params.batch == 0) return cudaSuccess;
  switch (params.dtype) {
    case ScalarType::kFloat32:
      return dispatch_head_dim<float>(params, stream);
    case ScalarType::kFloat16:
      return dispatch_head_dim<__half>(params, stream);
    case ScalarType::kBFloat16:
      return dispatch_head_dim<__nv_bfloat16>(params, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kvpress
