"""KV figures for every answer vLLM's server gives through the plugin: streams, batched prompts, n samples.

The worker reports each engine request's figures once, when it finishes, on
`EngineCoreOutput.kv_transfer_params["kvpress"]`. vLLM's OpenAI layer passes that dict on only in a
non-streaming response, and only the first prompt's (`request_output_to_completion_response` takes
`final_res_batch[0]`) or, for `n > 1`, the last sample's. Three hooks in the API process close the gaps:

- `n > 1`: vLLM runs the n samples as n child requests under one parent; their figures are collected
  on the parent and the parent's finished output carries the sum (`combine_figures`).
- batched prompts (`"prompt": [...]`): the completion response carries the sum over its prompts.
- streams with `stream_options.include_usage`: the final usage chunk (`"choices": []`) gets the same
  `kv_*` fields a non-streaming response has, summed over every request the stream served.

All three wrap vLLM 0.32 internals (the plugin pins that version); each wrapper falls back to vLLM's
own behaviour when what it looks for is absent.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

KEY = "kvpress"
#: Figures added to `usage`, besides `kv_policy`.
USAGE_FIELDS = ("kv_bytes", "kv_bytes_peak", "kv_retention", "kv_tokens_kept", "kv_tokens_full")
_SUMMED = ("kv_bytes", "kv_bytes_peak", "kv_tokens_kept", "kv_tokens_full", "compression_seconds", "preemptions")


def combine_figures(figures: list[dict[str, Any]]) -> dict[str, Any]:
    """One request's worth of KV figures for several engine requests answered together.

    Bytes, tokens and times add up; `kv_bytes_peak` is the sum of the peaks (the requests of one answer
    run side by side, so this bounds what they held at once); retention is kept over full tokens.
    """
    if len(figures) == 1:
        return dict(figures[0])
    combined: dict[str, Any] = {}
    policies = sorted({str(f.get("policy", "full")) for f in figures})
    combined["policy"] = policies[0] if len(policies) == 1 else ",".join(policies)
    for name in _SUMMED:
        values = [f[name] for f in figures if name in f]
        if values:
            combined[name] = round(sum(values), 6) if isinstance(values[0], float) else sum(values)
    full = combined.get("kv_tokens_full", 0)
    if full:
        combined["kv_retention"] = round(combined.get("kv_tokens_kept", 0) / full, 6)
    return combined


def usage_fields(figures: dict[str, Any]) -> dict[str, Any]:
    """The `usage` entries for one answer's figures (the same names `kvpress serve` uses)."""
    fields: dict[str, Any] = {"kv_policy": figures.get("policy", "full")}
    fields.update({k: figures[k] for k in USAGE_FIELDS if k in figures})
    return fields


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

    if getattr(RequestState, "_kvpress_wrapped", False):
        return
    original = RequestState.make_request_output

    def make_request_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        parent = getattr(self, "parent_req", None)
        if parent is None:
            return original(self, *args, **kwargs)
        bound = inspect.signature(original).bind(self, *args, **kwargs)
        params = bound.arguments.get("kv_transfer_params")
        if isinstance(params, dict) and isinstance(params.get(KEY), dict):
            collected: list[dict[str, Any]] = parent.__dict__.setdefault("_kvpress_figures", [])
            collected.append(params[KEY])
            bound.arguments["kv_transfer_params"] = _with_figures(params, None)
        output: Any = original(*bound.args, **bound.kwargs)
        if output is not None and getattr(output, "finished", False):
            collected = parent.__dict__.get("_kvpress_figures") or []
            if collected:
                output.kv_transfer_params = _with_figures(output.kv_transfer_params, combine_figures(collected))
        return output

    RequestState.make_request_output = make_request_output  # type: ignore[method-assign]
    RequestState._kvpress_wrapped = True  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------- batches


def _install_batch_combination() -> None:
    """A completion answering several prompts reports the sum of their figures, not the first prompt's."""
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    if getattr(OpenAIServingCompletion, "_kvpress_batch_wrapped", False):
        return
    original = OpenAIServingCompletion.request_output_to_completion_response

    def request_output_to_completion_response(self: Any, final_res_batch: list[Any], *args: Any, **kwargs: Any) -> Any:
        response = original(self, final_res_batch, *args, **kwargs)
        figures = [f for f in (_figures_of(res) for res in final_res_batch) if f is not None]
        if figures and hasattr(response, "kv_transfer_params"):
            response.kv_transfer_params = _with_figures(response.kv_transfer_params, combine_figures(figures))
        return response

    OpenAIServingCompletion.request_output_to_completion_response = request_output_to_completion_response  # type: ignore[method-assign]
    OpenAIServingCompletion._kvpress_batch_wrapped = True  # type: ignore[attr-defined]


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
        figures: list[dict[str, Any]] = []
        results = bound.arguments["result_generator"]

        async def watched() -> AsyncIterator[Any]:
            async for item in results:
                output = item[1] if isinstance(item, tuple) else item  # completions yield (prompt index, output)
                found = _figures_of(output)
                if found is not None:
                    figures.append(found)
                yield item

        bound.arguments["result_generator"] = watched()

        async def chunks() -> AsyncIterator[str]:
            async for chunk in original(*bound.args, **bound.kwargs):
                yield add_figures_to_usage_chunk(chunk, figures) if isinstance(chunk, str) else chunk

        return chunks()

    return generator


def _install_stream_usage() -> None:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    for cls, name in (
        (OpenAIServingCompletion, "completion_stream_generator"),
        (OpenAIServingChat, "chat_completion_stream_generator"),
    ):
        if getattr(cls, f"_kvpress_{name}_wrapped", False):
            continue
        setattr(cls, name, _wrap_stream_generator(getattr(cls, name)))
        setattr(cls, f"_kvpress_{name}_wrapped", True)


def install_usage_hooks() -> None:
    """All three hooks, once per process (the API process, or a script's `vllm.LLM`)."""
    try:
        _install_parent_collection()
        _install_batch_combination()
        _install_stream_usage()
    except ImportError:  # pragma: no cover - a vLLM without these modules: figures as vLLM passes them
        return
