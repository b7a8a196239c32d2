"""vLLM integration through the `vllm.general_plugins` entry point (not built yet)."""
