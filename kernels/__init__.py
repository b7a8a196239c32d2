"""Triton kernels for the ragged per-head paged KV cache (installed as ``vllm_kvpress_ext.kernels``)."""
