"""vLLM integration: `vllm serve MODEL --kv-policy NAME` on vLLM's own server, engine core and scheduler.

Installing the package registers two entry points under the one name `kvpress` (so a
`VLLM_PLUGINS` allowlist names them together):

- `vllm.platform_plugins` -> `platform_plugin`: says which platform serves (see `activation`).
- `vllm.general_plugins` -> `general_plugin`: adds `--kv-policy` to vLLM's CLI, GGUF models
  (`gguf_model`), the request middleware and the `kvpress_*` metrics to its API server (every vLLM
  process runs it).

Inside, the worker (`worker.KVPressWorker`) runs the project's `ModelRunner` (forward pass, per-
(layer, KV head) page pool, policy hooks) on the schedules vLLM's scheduler makes, and a scheduler
subclass (`scheduler.KVPressScheduler`) starts and preempts requests by that pool. See docs/vllm.md.
"""

from __future__ import annotations


def platform_plugin() -> str | None:
    """The qualified name of the platform class to use, or None to leave vLLM's own choice alone."""
    from vllm_kvpress_ext.vllm_plugin.activation import platform_to_activate

    return platform_to_activate()


def general_plugin() -> None:
    """Runs in every vLLM process before work starts; must be idempotent."""
    from vllm_kvpress_ext.vllm_plugin.activation import plugin_active
    from vllm_kvpress_ext.vllm_plugin.cli_args import install_kv_policy_flag
    from vllm_kvpress_ext.vllm_plugin.gguf_model import install_gguf_models

    install_kv_policy_flag()
    install_gguf_models()
    if plugin_active():
        from vllm_kvpress_ext.vllm_plugin.middleware import install_into_api_server

        install_into_api_server()
