"""Triton kernels for the ragged per-head paged KV cache (installed as ``vllm_kvpress_ext.kernels``).

Importing this package imports no Triton: each kernel module does, and `vllm_kvpress_ext.attention.ops`
imports them lazily, only for CUDA tensors. See README.md for the list and their oracles.
"""
