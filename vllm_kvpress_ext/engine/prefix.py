"""Prefill a shared prompt prefix once, then start many requests from their own copy of its cache.

For benchmarks that compare policies on the same prompts (accuracy vs memory): the context of a
sample is identical for every policy and budget, and on a CPU its prefill is nearly all of the
cost. `capture_prefix` runs the prefix through the engine once, uncompressed, recording what the
policies' prefill hooks read (window queries, hidden-state statistics, pre-RoPE keys: the union of
their `CaptureSpec`s); `add_forked_request` then gives a new request a private copy of those K/V
entries and of the capture cut to its own policy's spec, and compresses it exactly as the engine
does when a prefill of that length completes. The rest of the prompt (the question) and the answer
then run through ordinary engine steps. The result equals running the whole request from scratch
with `compress_after` at the prefix length (tests/test_prefix_fork.py checks outputs and kept entries).

Policies with a write gate (WG-KV) decide admission while the prefill runs, so they cannot start
from a shared uncompressed prefix; `add_forked_request` rejects them and callers run them whole.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_kvpress_ext.engine.origins import LoadedEntries
from vllm_kvpress_ext.engine.request import Request, RequestOutput
from vllm_kvpress_ext.engine.sampling_params import SamplingParams
from vllm_kvpress_ext.policies import KVPolicy, load_policy
from vllm_kvpress_ext.policies.base import AdmissionPolicy, LayerPrefill
from vllm_kvpress_ext.policies.capture import CaptureSpec, LayerCapture, PrefillCapture

if TYPE_CHECKING:
    from vllm_kvpress_ext.engine.engine import LLMEngine, PolicySpec


@dataclass
class PrefixSnapshot:
    """An uncompressed prefilled prefix: K/V `[L, H, n, d]`, each layer's prefill capture, and the
    greedy next token (what a request whose prompt is exactly the prefix answers first)."""

    token_ids: list[int]
    keys: torch.Tensor
    values: torch.Tensor
    spec: CaptureSpec
    layers: list[LayerCapture]
    next_token: int

    @property
    def length(self) -> int:
        return len(self.token_ids)


@dataclass
class _CaptureOnly(KVPolicy):
    """Asks the forward pass for `spec`, hands the per-layer captures to the caller, keeps everything."""

    spec: CaptureSpec = dataclasses.field(default_factory=CaptureSpec)
    name = "capture-only"

    def capture_spec(self) -> CaptureSpec:
        return self.spec

    def on_layer_prefilled(self, layer: LayerPrefill, state: dict[str, Any]) -> Any:
        # By the model's layer: a model's sliding-window layers are no policy's, so they get no hook.
        state.setdefault("captures", {})[layer.model_layer_index] = layer.capture
        return None


def merged_capture_spec(policies: list[KVPolicy | None]) -> CaptureSpec:
    spec = CaptureSpec()
    for policy in policies:
        if policy is not None and policy.compresses:
            spec = spec.merge(policy.capture_spec())
    return spec


@torch.no_grad()
def capture_prefix(
    engine: LLMEngine,
    token_ids: list[int],
    spec: CaptureSpec,
    request_id: str,
    finished: dict[str, RequestOutput] | None = None,
) -> PrefixSnapshot:
    """Prefill `token_ids` and return its K/V and captures.

    Other requests may be running only when `finished` is given: the steps taken here advance them
    too, and the outputs of those that finish are stored there for the caller.
    """
    if engine.has_unfinished_requests() and finished is None:
        raise RuntimeError("capture_prefix needs an idle engine, or a `finished` dict for the others' outputs")
    snapshot: dict[str, Any] = {}

    def keep(request: Request) -> None:
        if request.request_id != request_id:
            return
        keys, values = [], []
        n = len(token_ids)
        for layer, window in enumerate(engine.config.layer_windows):
            k, v, positions, _ = engine.cache.gather_layer(request_id, layer)
            positions = positions.to(torch.int64)
            if window is None:
                expected = torch.arange(n, device=positions.device).expand_as(positions)
                assert torch.equal(positions, expected), "the prefix cache must be uncompressed"
                keys.append(k.clone())
                values.append(v.clone())
                continue
            # A sliding layer's ring holds the last `window` positions in ring order. Laid out by position (the
            # older ones zero), the copy goes back in through `LoadedEntries`, whose appends write only those.
            held = torch.arange(max(0, n - window), n, device=positions.device)
            assert torch.equal(positions.sort(dim=-1).values, held.expand_as(positions)), "a ring must be whole"
            index = positions.unsqueeze(-1).expand_as(k)
            keys.append(k.new_zeros(k.shape[0], n, k.shape[-1]).scatter_(1, index, k))
            values.append(v.new_zeros(v.shape[0], n, v.shape[-1]).scatter_(1, index, v))
        snapshot["keys"], snapshot["values"] = torch.stack(keys), torch.stack(values)
        captures = (request.seat.policy_state or {}).get("captures") or {}
        snapshot["layers"] = [captures.get(layer) or LayerCapture() for layer in range(len(keys))]
        for layer_capture in snapshot["layers"]:
            layer_capture.shared = {}
        snapshot["next_token"] = request.output_token_ids[0]

    policy = _CaptureOnly(spec) if not spec.empty else None
    engine.finish_hooks.append(keep)
    try:
        engine.add_request(token_ids, SamplingParams(max_tokens=1, temperature=0.0), request_id, policy=policy)
        while "keys" not in snapshot:
            for out in engine.step():
                if out.finished and out.request_id != request_id and finished is not None:
                    finished[out.request_id] = out
    finally:
        engine.finish_hooks.remove(keep)
    return PrefixSnapshot(
        list(token_ids), snapshot["keys"], snapshot["values"], spec, snapshot["layers"], snapshot["next_token"]
    )


def _own_capture(snapshot: PrefixSnapshot, spec: CaptureSpec, engine: LLMEngine) -> PrefillCapture | None:
    """The capture the policy would have recorded itself: the snapshot's, cut to `spec`."""
    if spec.empty:
        return None
    capture = PrefillCapture(spec, engine.config.num_hidden_layers, engine.model.rotary)
    for layer, (mine, shared) in enumerate(zip(capture.layers, snapshot.layers, strict=True)):
        if engine.config.layer_sliding_window(layer) is not None:
            continue  # no policy reads a sliding-window layer's capture
        mine.shared = shared.shared
        if spec.window:
            assert shared.queries is not None and shared.query_positions is not None
            mine.queries = shared.queries[-spec.window :].clone()
            mine.query_positions = shared.query_positions[-spec.window :].clone()
            if spec.query_lse:
                lse = None if shared.lse_missing else shared.query_lse
                mine.query_lse = None if lse is None else lse[-spec.window :].clone()
                mine.lse_missing = lse is None
        if spec.hidden_stats:
            mine.hidden_sum, mine.hidden_sq_sum = shared.hidden_sum, shared.hidden_sq_sum
            mine.hidden_count = shared.hidden_count
        if spec.keys_pre_rope:
            mine.keys_pre_rope, mine.keys_post_rope = list(shared.keys_pre_rope), list(shared.keys_post_rope)
        if spec.query_moments:
            mine.query_sum, mine.query_outer_sum = shared.query_sum, shared.query_outer_sum
            mine.query_count = shared.query_count
        if spec.reconstruction is not None:  # the prefix's own pass scored its entries for every fork
            mine.reconstruction_scores = shared.reconstruction_scores
        if spec.leading_queries and shared.leading_queries is not None:
            mine.leading_queries = shared.leading_queries[: spec.leading_queries]
    return capture


@torch.no_grad()
def add_forked_request(
    engine: LLMEngine,
    snapshot: PrefixSnapshot,
    prompt: list[int],
    params: SamplingParams,
    request_id: str,
    policy: PolicySpec | None,
) -> str:
    """Start `prompt` (which begins with the snapshot's prefix) from a copy of the prefix cache.

    The policy compresses right away, as if a prefill with `compress_after=snapshot.length` had just
    completed; the remaining prompt tokens (one chunk where the policy allows, `ModelRunner.runs_tail_as_chunk`)
    and the answer go through the engine's steps.
    """
    n = snapshot.length
    if prompt[:n] != snapshot.token_ids or len(prompt) <= n:
        raise ValueError("the prompt must extend the snapshot's prefix by at least one token")
    resolved = load_policy(policy)
    if resolved is not None and not resolved.compresses:
        resolved = None
    store = engine.runner.gate_store
    if isinstance(resolved, AdmissionPolicy) and resolved.admission(engine.model_dir, engine.device, store) is not None:
        raise ValueError(f"policy {resolved.name!r} gates writes during prefill; run it on the whole prompt instead")
    spec = resolved.capture_spec() if resolved is not None else CaptureSpec()
    if spec.merge(snapshot.spec) != snapshot.spec:
        raise ValueError(f"the prefix was captured with {snapshot.spec}, which lacks what {resolved} needs ({spec})")
    if request_id in engine.requests:
        raise ValueError(f"request id {request_id!r} is already in use")
    if engine.cache.pages_for_prompt(n) > engine.runner.free_pages:
        raise RuntimeError(f"the pool has no room for a copy of the {n}-token prefix")
    # The checks every request passes (vocabulary, length, boundary, pool), as if it were added whole.
    request = engine.runner.new_request(
        request_id, list(prompt), params, resolved, max_model_len=engine.max_model_len, compress_after=n
    )
    engine.runner.start(request, LoadedEntries(snapshot.keys, snapshot.values, _own_capture(snapshot, spec, engine)))
    engine.adopt_prefilled(request)  # compresses (when there is a policy) and marks it running
    return request_id
