// Python binding of the CUDA paged decode kernel (torch extension `kvpress_paged_decode`).
//
// Validates the tensors, allocates the output and the split partials, and launches on the stream the
// caller passes (`torch.cuda.current_stream().cuda_stream`), with the caller holding the device guard
// (`with torch.cuda.device(...)`). Taking both from Python keeps this file on torch's CPU-side headers
// plus the CUDA runtime: c10/cuda and ATen/cuda headers need generated files that CPU builds of torch
// do not ship and cuBLAS / cuSPARSE headers that a minimal toolkit lacks, so this way the binding
// compiles (and is compile-tested) anywhere nvcc and torch are. Index dtypes are fixed here (int32
// tables and lengths, int64 rows and ring lengths); the Python wrapper (kernels/cuda_decode.py)
// converts them and picks the split size.
#include <cuda_runtime_api.h>
#include <torch/extension.h>

#include <optional>

#include "paged_decode.h"

namespace {

kvpress::ScalarType scalar_type_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32:
      return kvpress::ScalarType::kFloat32;
    case torch::kFloat16:
      return kvpress::ScalarType::kFloat16;
    case torch::kBFloat16:
      return kvpress::ScalarType::kBFloat16;
    default:
      TORCH_CHECK(false, "paged_decode: unsupported dtype ", t.scalar_type());
  }
}

torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& kv_pool,
                                     const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                                     const torch::Tensor& rows, const std::optional<torch::Tensor>& ring_tables,
                                     const std::optional<torch::Tensor>& ring_lens, double scale, int64_t num_splits,
                                     int64_t split_tokens, int64_t stream) {
  TORCH_CHECK(query.is_cuda() && kv_pool.is_cuda() && block_tables.is_cuda() && seq_lens.is_cuda() && rows.is_cuda(),
              "paged_decode: every tensor must be on CUDA");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "paged_decode: query must be [B, Hq, D] with a contiguous D");
  TORCH_CHECK(kv_pool.dim() == 4 && kv_pool.size(1) == 2 && kv_pool.is_contiguous(),
              "paged_decode: kv_pool must be a contiguous [P, 2, page_size, D]");
  TORCH_CHECK(query.scalar_type() == kv_pool.scalar_type(), "paged_decode: query and kv_pool dtypes differ");
  TORCH_CHECK(kv_pool.size(3) == query.size(2), "paged_decode: head_dim of query and kv_pool differ");
  TORCH_CHECK(block_tables.dim() == 3 && block_tables.scalar_type() == torch::kInt32 && block_tables.stride(2) == 1,
              "paged_decode: block_tables must be int32 [R, Hkv, P] with a contiguous last dim");
  TORCH_CHECK(seq_lens.dim() == 2 && seq_lens.scalar_type() == torch::kInt32, "paged_decode: seq_lens must be int32");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt64 && rows.is_contiguous(),
              "paged_decode: rows must be a contiguous int64 [B]");
  TORCH_CHECK(num_splits >= 1 && split_tokens >= 1, "paged_decode: num_splits and split_tokens must be >= 1");
  const bool has_ring = ring_tables.has_value() && ring_lens.has_value() && ring_tables->size(-1) > 0;
  if (has_ring) {
    TORCH_CHECK(ring_tables->is_cuda() && ring_lens->is_cuda(), "paged_decode: ring tensors must be on CUDA");
    TORCH_CHECK(ring_tables->dim() == 3 && ring_tables->scalar_type() == torch::kInt32 && ring_tables->stride(2) == 1,
                "paged_decode: ring_tables must be int32 [R, Hkv, Pr] with a contiguous last dim");
    TORCH_CHECK(ring_lens->dim() == 1 && ring_lens->scalar_type() == torch::kInt64,
                "paged_decode: ring_lens must be int64 [R]");
  }

  const int64_t batch = query.size(0);
  const int64_t num_q_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  auto out = torch::empty({batch, num_q_heads, head_dim}, query.options());
  const auto f32 = query.options().dtype(torch::kFloat32);
  auto partial_max = torch::empty({batch, num_q_heads, num_splits}, f32);
  auto partial_sum = torch::empty({batch, num_q_heads, num_splits}, f32);
  auto partial_acc = torch::empty({batch, num_q_heads, num_splits, head_dim}, f32);

  kvpress::PagedDecodeParams p{};
  p.query = query.data_ptr();
  p.kv = kv_pool.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.rows = rows.data_ptr<int64_t>();
  p.ring_tables = has_ring ? ring_tables->data_ptr<int32_t>() : nullptr;
  p.ring_lens = has_ring ? ring_lens->data_ptr<int64_t>() : nullptr;
  p.out = out.data_ptr();
  p.partial_max = partial_max.data_ptr<float>();
  p.partial_sum = partial_sum.data_ptr<float>();
  p.partial_acc = partial_acc.data_ptr<float>();
  p.query_stride_b = query.stride(0);
  p.query_stride_h = query.stride(1);
  p.table_stride_r = block_tables.stride(0);
  p.table_stride_h = block_tables.stride(1);
  p.lens_stride_r = seq_lens.stride(0);
  p.lens_stride_h = seq_lens.stride(1);
  p.ring_stride_r = has_ring ? ring_tables->stride(0) : 0;
  p.ring_stride_h = has_ring ? ring_tables->stride(1) : 0;
  p.ring_lens_stride = has_ring ? ring_lens->stride(0) : 0;
  p.batch = static_cast<int>(batch);
  p.num_q_heads = static_cast<int>(num_q_heads);
  p.num_kv_heads = static_cast<int>(block_tables.size(1));
  p.head_dim = static_cast<int>(head_dim);
  p.page_size = static_cast<int>(kv_pool.size(2));
  p.num_splits = static_cast<int>(num_splits);
  p.split_tokens = static_cast<int>(split_tokens);
  p.scale = static_cast<float>(scale);
  p.dtype = scalar_type_of(query);

  const cudaError_t err = kvpress::paged_decode(p, reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "paged_decode: launch failed: ", cudaGetErrorString(err),
              " (head_dim must be 64 or 128 and Hq / Hkv at most 16)");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Ragged per-head paged decode attention (split-K); see csrc/paged_decode.cu", py::arg("query"),
        py::arg("kv_pool"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("rows"), py::arg("ring_tables"),
        py::arg("ring_lens"), py::arg("scale"), py::arg("num_splits"), py::arg("split_tokens"),
        py::arg("stream"));
}
