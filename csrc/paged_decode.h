// Ragged per-head paged decode attention: the CUDA kernel's host interface.
//
// Kept free of torch headers so that `paged_decode.cu` compiles with nvcc alone (fast, and testable
// where only the CUDA toolkit is installed); `binding.cpp` turns torch tensors into these parameters.
// Layout and semantics: see paged_decode.cu and vllm_kvpress_ext/attention/reference.py.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace kvpress {

enum class ScalarType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct PagedDecodeParams {
  const void* query;             // [B, Hq, D], element strides query_stride_b / query_stride_h, last dim contiguous
  const void* kv;                // [P, 2, page_size, D], contiguous
  const int32_t* block_tables;   // [R, Hkv, max_pages] (element strides table_stride_r / table_stride_h)
  const int32_t* seq_lens;       // [R, Hkv] (element strides lens_stride_r / lens_stride_h)
  const int64_t* rows;           // [B] cache row of each query
  const int32_t* ring_tables;    // [R, Hkv, ring_pages] or nullptr
  const int64_t* ring_lens;      // [R] (element stride ring_lens_stride) or nullptr
  void* out;                     // [B, Hq, D], contiguous
  float* partial_max;            // [B, Hq, num_splits]            (log2 domain)
  float* partial_sum;            // [B, Hq, num_splits]
  float* partial_acc;            // [B, Hq, num_splits, D]
  int64_t query_stride_b;
  int64_t query_stride_h;
  int64_t table_stride_r;
  int64_t table_stride_h;
  int64_t lens_stride_r;
  int64_t lens_stride_h;
  int64_t ring_stride_r;
  int64_t ring_stride_h;
  int64_t ring_lens_stride;
  int batch;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;                  // 64 or 128
  int page_size;
  int num_splits;                // >= 1
  int split_tokens;              // tokens of a head handled by one split
  float scale;                   // softmax scale (1 / sqrt(D) usually)
  ScalarType dtype;              // of query, kv and out alike
};

// Launches the split kernel and the reduction on `stream`. Returns cudaErrorInvalidValue for an
// unsupported head_dim / group size, otherwise the launch status.
cudaError_t paged_decode(const PagedDecodeParams& params, cudaStream_t stream);

}  // namespace kvpress
