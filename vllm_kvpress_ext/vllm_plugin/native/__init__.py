"""vLLM's own model runner and model zoo under the plugin (`additional_config={"kv_runner": "vllm"}`).

The first step of moving the plugin onto vLLM's runner: vLLM's `CPUModelRunner` drives vLLM's
model implementation of whatever architecture the checkpoint names, vLLM's sampler and logits
processors run, and this package brings what vLLM's CUDA wheel lacks on a CPU: a worker that starts
the runner without `vllm._C` (`worker.py`), an attention backend in torch (`attention.py`), and the
two places where vLLM's runner calls a compiled op directly, replaced in one module (`adapter.py`).

What this step does not do yet: compression. The KV cache is vLLM's own block layout, sized and
scheduled by vLLM, so only the `full` policy is served on this path; the per-(layer, KV head) pool,
admission and the policies move behind the attention backend in the next steps (docs/architecture.md,
"The plugin on vLLM's own runner").
"""
