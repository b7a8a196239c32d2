"""KV figures for every answer vLLM's server gives through the plugin: streams, batched prompts, n samples.

The worker reports each engine request's figures when it finishes (and, for a request with stop strings,
which the API process may end after any step, at every step) on
`EngineCoreOutput.kv_transfer_params["kvpress"]`. vLLM's OpenAI layer passes that dict on only in a
non-streaming response, and only the first prompt's (`request_output_to_completion_response` takes
`final_res_batch[0]`) or, for `n > 1`, the last sample's. Three hooks in the API process close the gaps:

- `n > 1`: vLLM runs the n samples as n child requests under one parent; their figures are collected
  on the parent and the parent's finished output carries the sum (`combine_figures`).
- batched prompts (`"prompt": [...]`): the completion response carries the sum over its prompts.
- streams with `stream_options.include_usage`: the final usage chunk (`"choices": []`) gets the same
  `kv_*` fields a non-streaming response has, summed over every request the stream served.

All three wrap vLLM internals (listed in `patches.py`); each wrapper falls back to vLLM's
own behaviour when what it looks for is absent.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from vllm_kvpress_ext.api.usage import combine_figures, usage_fields
from vllm_kvpress_ext.vllm_plugin.patches import wrap

KEY = "kvpress"


def _figures_of(output: Any) -> dict[str, Any] | None:
    params = getattr(output, "kv_transfer_params", None)
    if isinstance(params, dict) and isinstance(params.get(KEY), dict):
        return params[KEY]
    return None


def _with_figures(params: dict[str, Any] | None, figures: dict[str, Any] | None) -> dict[str, Any] | None:
    rest = {k: v for k, v in (params or {}).items() if k != KEY}
    if figures is not None:
        rest[KEY] = figures
    return rest or None


# ---------------------------------------------------------------------------------------- n > 1


def _install_parent_collection() -> None:
    """Children of one parent (`n > 1`) hand their figures to the parent; its finished output carries the sum."""
    from vllm.v1.engine.output_processor import RequestState

    def wrap_make_request_output(original: Any) -> Any:
        def make_request_output(self: Any, *args: Any, **kwargs: Any) -> Any:
            parent = getattr(self, "parent_req", None)
            if parent is None:
                return original(self, *args, **kwargs)
            bound = inspect.signature(original).bind(self, *args, **kwargs)
            params = bound.arguments.get("kv_transfer_params")
            if isinstance(params, dict) and isinstance(params.get(KEY), dict):
                # Each child's latest figures (a child that may stop on text reports them at every step).
                collected: dict[str, dict[str, Any]] = parent.__dict__.setdefault("_kvpress_figures", {})
                collected[self.request_id] = params[KEY]
                bound.arguments["kv_transfer_params"] = _with_figures(params, None)
            output: Any = original(*bound.args, **bound.kwargs)
            if output is not None and getattr(output, "finished", False):
                collected = parent.__dict__.get("_kvpress_figures") or {}
                if collected:
                    combined = combine_figures(list(collected.values()))
                    output.kv_transfer_params = _with_figures(output.kv_transfer_params, combined)
            return output

        return make_request_output

    wrap(RequestState, "make_request_output", wrap_make_request_output, "usage")


# ---------------------------------------------------------------------------------------- batches


def _install_batch_combination() -> None:
    """A completion answering several prompts reports the sum of their figures, not the first prompt's."""
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    def wrap_response(original: Any) -> Any:
        def request_output_to_completion_response(
            self: Any, final_res_batch: list[Any], *args: Any, **kwargs: Any
        ) -> Any:
            response = original(self, final_res_batch, *args, **kwargs)
            figures = [f for f in (_figures_of(res) for res in final_res_batch) if f is not None]
            if figures and hasattr(response, "kv_transfer_params"):
                response.kv_transfer_params = _with_figures(response.kv_transfer_params, combine_figures(figures))
            return response

        return request_output_to_completion_response

    wrap(OpenAIServingCompletion, "request_output_to_completion_response", wrap_response, "usage")


# ---------------------------------------------------------------------------------------- streams


def add_figures_to_usage_chunk(chunk: str, figures: list[dict[str, Any]]) -> str:
    """`chunk` with the KV figures in its `usage`, when it is the stream's final usage chunk (no choices)."""
    if not figures or not chunk.startswith("data: ") or '"usage"' not in chunk:
        return chunk
    try:
        payload = json.loads(chunk[len("data: ") :])
    except ValueError:
        return chunk
    if not isinstance(payload, dict) or payload.get("choices") or not isinstance(payload.get("usage"), dict):
        return chunk  # a choice chunk with continuous usage: the figures come once, at the end
    payload["usage"].update(usage_fields(combine_figures(figures)))
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _wrap_stream_generator(original: Callable[..., AsyncIterator[str]]) -> Callable[..., AsyncIterator[str]]:
    signature = inspect.signature(original)

    def generator(self: Any, *args: Any, **kwargs: Any) -> AsyncIterator[str]:
        bound = signature.bind(self, *args, **kwargs)
        figures: dict[Any, dict[str, Any]] = {}  # each request's latest (one that may stop on text: every step)
        results = bound.arguments["result_generator"]

        async def watched() -> AsyncIterator[Any]:
            async for item in results:
                output = item[1] if isinstance(item, tuple) else item  # completions yield (prompt index, output)
                found = _figures_of(output)
                if found is not None:
                    figures[getattr(output, "request_id", None) or len(figures)] = found
                yield item

        bound.arguments["result_generator"] = watched()

        async def chunks() -> AsyncIterator[str]:
            async for chunk in original(*bound.args, **bound.kwargs):
                final = list(figures.values())
                yield add_figures_to_usage_chunk(chunk, final) if isinstance(chunk, str) else chunk

        return chunks()

    return generator


def _install_stream_usage() -> None:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    for cls, name in (
        (OpenAIServingCompletion, "completion_stream_generator"),
        (OpenAIServingChat, "chat_completion_stream_generator"),
    ):
        wrap(cls, name, _wrap_stream_generator, "usage")


def install_usage_hooks() -> None:
    """All three hooks, once per process (the API process, or a script's `vllm.LLM`)."""
    try:
        _install_parent_collection()
        _install_batch_combination()
        _install_stream_usage()
    except ImportError:  # pragma: no cover - a vLLM without these modules: figures as vLLM passes them
        return
