"""vLLM's own model runner and model zoo under the plugin (`additional_config={"kv_runner": "vllm"}`).

vLLM's `CPUModelRunner` (subclassed in `runner.py`) drives vLLM's implementation of whatever
architecture the checkpoint names, and vLLM's sampler and logits processors run. This package brings
the rest: the project's per-(layer, KV head) page pool as the KV cache and the policies run on it
(`pool.py`), the attention backend over that pool (`attention.py`), which policies this runner serves
and what it takes to (`support.py`), a worker that starts the runner without `vllm._C` and reports
the pool to `KVPressScheduler` each step (`worker.py`), and the places where vLLM's runner calls a
compiled op directly, replaced in one module (`adapter.py`). docs/architecture.md, "The plugin on
vLLM's own runner", says what runs where and why.
"""
