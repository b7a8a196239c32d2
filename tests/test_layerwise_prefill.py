"""Layer-wise prefill compression: each layer compressed right after its attention in the last chunk.

Checked here: the cache's per-layer append, per-layer compaction and exact page high-water mark;
the engine path against end-of-prefill compression (XKV with a profile: the same kept entries, the
same greedy tokens, and the prefill peak by exact page arithmetic, one chunk and chunked); LAVa's
cascading form (final budgets equal the paper's B_l, peak below the one-shot form); re-plans of
earlier layers mapped onto compacted entries; mixed batches; and `kvpress bench prefill-peak`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_kvpress_ext.bench.prefill_peak import PrefillPeakConfig, run_prefill_peak_bench
from vllm_kvpress_ext.cache import InvalidPlanError, KeepPlan, PagedKVCache
from vllm_kvpress_ext.cli import main
from vllm_kvpress_ext.engine import LLMEngine, SamplingParams
from vllm_kvpress_ext.models.writer import llama_config, random_model, save_model
from vllm_kvpress_ext.policies import KVPolicy, LavaPolicy, PolicyConfigError, XKVPolicy, load_policy
from vllm_kvpress_ext.policies.base import LayerKeep, LayerPrefill, RequestPrefill
from vllm_kvpress_ext.policies.lava import layer_budgets, prefill_peak_entries
from vllm_kvpress_ext.policies.xkv import XKVProfile

PAGE = 4
LAYERS, HEADS = 4, 2
N = 100  # prompt tokens
WINDOW = 8
FRACTIONS = [0.1, 0.5, 0.2, 0.3]


def pages(tokens: int) -> int:
    return -(-tokens // PAGE)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = llama_config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=LAYERS,
        num_heads=4,
        num_kv_heads=HEADS,
        max_position_embeddings=512,
    )
    return save_model(random_model(config, seed=0, std=0.3), config, tmp_path_factory.mktemp("layerwise_model"))


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(XKVProfile(FRACTIONS, window=WINDOW).save(tmp_path_factory.mktemp("profile") / "xkv.yaml"))


class EndOfPrefillXKV(XKVPolicy):
    """XKV with a profile, forced onto the end-of-prefill path (the reference for the layer-wise one)."""

    @property
    def compresses_layerwise(self) -> bool:
        return False


def prompt(n: int = N, seed: int = 1) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class Run:
    tokens: list[int]
    peak_pages: int
    final_pages: int
    kept_per_head: list[list[int]]
    kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per layer: keys, values, positions
    state: Any


def engine_for(model_dir: Path, chunk: int = 256) -> LLMEngine:
    return LLMEngine(model_dir, dtype=torch.float32, num_pages=1024, page_size=PAGE, max_num_batched_tokens=chunk)


def run(
    model_dir: Path,
    policy: Any,
    *,
    chunk: int = 256,
    compress_after: int | None = None,
    max_tokens: int = 1,
    ids: list[int] | None = None,
) -> Run:
    engine = engine_for(model_dir, chunk)
    kept: dict[str, Any] = {}

    def hook(request: Any) -> None:
        layers = [engine.cache.gather_layer(request.request_id, layer)[:3] for layer in range(LAYERS)]
        kept.update(layers=layers, state=request.seat.policy_state)

    engine.finish_hooks.append(hook)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt() if ids is None else ids, params, policy=policy, compress_after=compress_after)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert engine.cache.pool.num_used == 0
    kv = outputs[0].kv
    page_bytes = engine.cache.pool.bytes_per_page
    return Run(
        outputs[0].output_token_ids,
        kv.kv_bytes_peak // page_bytes,
        kv.kv_bytes // page_bytes,
        kv.kept_per_head,
        kept["layers"],
        kept["state"],
    )


def assert_same_cache(a: Run, b: Run) -> None:
    for (ka, va, pa), (kb, vb, pb) in zip(a.kept, b.kept, strict=True):
        assert torch.equal(pa, pb)
        valid = pa >= 0  # past a head's length the padded gather reads stale slots
        assert torch.equal(ka[valid], kb[valid]) and torch.equal(va[valid], vb[valid])


# ----------------------------------------------------------------------------- the cache


def test_cache_appends_compacts_one_layer_and_tracks_the_exact_peak() -> None:
    cache = PagedKVCache(3, 2, 4, num_pages=64, page_size=PAGE, dtype=torch.float32)
    row = cache.add_request("a")
    slots = cache.append_layer_slots(1, row, torch.arange(6))
    assert slots.shape == (2, 6)
    assert cache.seq_lens[:, row].tolist() == [[0, 0], [6, 6], [0, 0]]
    assert cache.pool.num_used == 2 * pages(6) == cache.peak_pages("a")
    assert cache.pool.positions.view(-1)[slots].tolist() == [list(range(6))] * 2
    keys = torch.arange(2 * 6 * 4, dtype=torch.float32).view(6, 2, 4)
    cache.write(slots.transpose(0, 1), keys, -keys)
    for layer in (0, 2):
        cache.write(cache.append_layer_slots(layer, row, torch.arange(6)).transpose(0, 1), keys, keys)
    assert cache.peak_pages("a") == 3 * 2 * pages(6) == cache.usage("a").pages

    mask = torch.zeros(1, 2, 6, dtype=torch.bool)
    mask[0, 0, [0, 5]] = True
    mask[0, 1, [1, 2, 3, 4, 5]] = True
    freed = cache.apply_keep_plan("a", KeepPlan.from_mask(mask), layers=[1])
    assert freed == 1 and cache.seq_lens[:, row].tolist() == [[6, 6], [2, 5], [6, 6]]
    k, v, pos = cache.gather("a", 1, 0)
    assert pos.tolist() == [0, 5] and torch.equal(k, keys[[0, 5], 0]) and torch.equal(v, -keys[[0, 5], 0])
    assert cache.gather("a", 1, 1)[2].tolist() == [1, 2, 3, 4, 5]
    assert cache.peak_pages("a") == 12 and cache.usage("a").pages == 11  # the peak stays a high-water mark

    # Plan rows follow `layers`, in the order given; entries are indices into the current (compacted) entries.
    plan = KeepPlan.from_lists([[[5], [0]], [[0], [1]]])
    cache.apply_keep_plan("a", plan, layers=[2, 1])
    assert cache.seq_lens[:, row].tolist() == [[6, 6], [1, 1], [1, 1]]
    assert cache.gather("a", 1, 1)[2].tolist() == [2] and cache.gather("a", 2, 0)[2].tolist() == [5]

    before = (cache.seq_lens.clone(), cache.block_tables.clone(), cache.pool.num_free)
    for layers, error in (([3], "non-empty list in"), ([0, 0], "distinct"), ([0, 2], "covers")):
        with pytest.raises(InvalidPlanError, match=error):
            cache.apply_keep_plan("a", KeepPlan.from_lists([[[0], [0]]]), layers=layers)
    assert torch.equal(before[0], cache.seq_lens) and torch.equal(before[1], cache.block_tables)
    assert before[2] == cache.pool.num_free
    with pytest.raises(ValueError, match="out of range"):
        cache.append_layer_slots(3, row, torch.arange(2))

    assert cache.usage("a").pages == 8
    cache.append_slots([row], torch.arange(6, 9).view(1, -1))  # 10 pages: below the mark
    assert cache.peak_pages("a") == 12
    cache.append_slots([row], torch.arange(9, 16).view(1, -1))  # layer 0: 16 entries, layers 1-2: 11
    assert cache.peak_pages("a") == cache.usage("a").pages == 2 * (pages(16) + 2 * pages(11)) == 20
    cache.free_request("a")
    row = cache.add_request("b")
    assert cache.peak_pages("b") == 0


# ----------------------------------------------------------------------------- opting in


def test_policies_opt_in_only_when_the_plan_needs_no_later_layer(profile: str) -> None:
    assert not XKVPolicy().compresses_layerwise and not XKVPolicy(target_ratio=0.9).compresses_layerwise
    assert XKVPolicy(profile=profile).compresses_layerwise
    assert not LavaPolicy().compresses_layerwise
    cascading = load_policy({"name": "lava", "cascading": True})
    assert isinstance(cascading, LavaPolicy) and cascading.compresses_layerwise
    with pytest.raises(PolicyConfigError, match="cascading must be bool"):
        load_policy({"name": "lava", "cascading": "yes"})
    snapkv = load_policy("snapkv")
    assert snapkv is not None and not snapkv.compresses_layerwise


# ----------------------------------------------------------------------------- XKV with a profile


@pytest.mark.parametrize(
    ("chunk", "compress_after"), [(256, None), (32, None), (256, 70)], ids=["one-chunk", "chunked", "compress-after"]
)
def test_xkv_profile_layerwise_equals_end_of_prefill(
    model_dir: Path, profile: str, chunk: int, compress_after: int | None
) -> None:
    layerwise = run(model_dir, XKVPolicy(profile=profile), chunk=chunk, compress_after=compress_after, max_tokens=5)
    reference = run(
        model_dir, EndOfPrefillXKV(profile=profile), chunk=chunk, compress_after=compress_after, max_tokens=5
    )
    assert layerwise.tokens == reference.tokens
    assert_same_cache(layerwise, reference)
    assert layerwise.state["allocation"] == reference.state["allocation"]
    assert layerwise.state["r_avg"] == reference.state["r_avg"]
    assert layerwise.final_pages == reference.final_pages


@pytest.mark.parametrize("chunk", [256, 32], ids=["one-chunk", "chunked"])
def test_xkv_profile_prefill_peak_by_page_arithmetic(model_dir: Path, profile: str, chunk: int) -> None:
    layerwise = run(model_dir, XKVPolicy(profile=profile), chunk=chunk)
    reference = run(model_dir, EndOfPrefillXKV(profile=profile), chunk=chunk)
    allocation = [round(f * (N - WINDOW)) for f in FRACTIONS]  # no budget: m_l = round(f_l P), here no ties
    assert layerwise.state["allocation"] == allocation == [9, 46, 18, 28]
    kept = [m + WINDOW for m in allocation]  # every KV head of layer l keeps the window plus m_l
    assert layerwise.kept_per_head == reference.kept_per_head == [[k] * HEADS for k in kept]
    # Earlier chunks hold their prefix in every layer; the last chunk allocates layer l whole (all N
    # entries) while layers < l are compressed and layers > l still hold only the prefix.
    prefix = (N - 1) // chunk * chunk  # where the last chunk starts
    expected = max(
        sum(HEADS * pages(k) for k in kept[:layer]) + HEADS * pages(N) + (LAYERS - 1 - layer) * HEADS * pages(prefix)
        for layer in range(LAYERS)
    )
    assert layerwise.peak_pages == expected == {256: 102, 32: 194}[chunk]
    assert reference.peak_pages == LAYERS * HEADS * pages(N) == 200
    assert layerwise.peak_pages < reference.peak_pages
    assert layerwise.final_pages == reference.final_pages == sum(HEADS * pages(k) for k in kept)


# ----------------------------------------------------------------------------- LAVa cascading


def test_lava_cascading_ends_at_the_paper_budgets_below_the_one_shot_peak(model_dir: Path) -> None:
    spec = {"name": "lava", "tokens": 40, "window": WINDOW}
    engine = engine_for(model_dir)
    usage_at_allocation: list[int] = []
    append = engine.cache.append_layer_slots

    def recording(layer: int, row: int, positions: torch.Tensor) -> torch.Tensor:
        slots = append(layer, row, positions)
        usage_at_allocation.append(engine.cache.pool.num_used)  # the only request in the pool
        return slots

    engine.cache.append_layer_slots = recording  # type: ignore[method-assign]
    states: list[Any] = []
    engine.finish_hooks.append(lambda r: states.append(r.seat.policy_state))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt(), params, policy={**spec, "cascading": True})
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    (out,) = finished
    record = states[0]["lava"]

    # The paper's final B_l: T_l = e_l / sum(e) T over all L layers (T = L H (B - w)), plus the window.
    total, cap = LAYERS * HEADS * (40 - WINDOW), HEADS * (N - WINDOW)
    final = [t + HEADS * WINDOW for t in layer_budgets(record["entropies"], total, cap)]
    assert record["layer_budgets"] == final
    assert [sum(heads) for heads in out.kv.kept_per_head] == final
    assert len(record["cascade"]) == LAYERS and record["cascade"][0] == [cap]  # layer 0 alone keeps everything

    page_bytes = engine.cache.pool.bytes_per_page
    assert len(usage_at_allocation) == LAYERS
    assert out.kv.kv_bytes_peak == max(usage_at_allocation) * page_bytes  # the high-water mark is exact
    one_shot = run(model_dir, spec)
    assert one_shot.peak_pages == LAYERS * HEADS * pages(N)
    peak_pages = out.kv.kv_bytes_peak // page_bytes
    assert peak_pages < one_shot.peak_pages
    # The cascade's entry peak in pages, each (layer, head) rounding up to whole pages at most once.
    entries = prefill_peak_entries(record["cascade"], HEADS, N, WINDOW)["cascading"]
    assert peak_pages <= pages(entries) + LAYERS * HEADS


def test_lava_cascading_keeps_the_one_shot_sets(model_dir: Path) -> None:
    """Same scores, budgets that only shrink: the cascade ends on the one-shot plan (see lava.py)."""
    spec = {"name": "lava", "tokens": 40, "window": WINDOW}
    cascading = run(model_dir, {**spec, "cascading": True}, max_tokens=4)
    one_shot = run(model_dir, spec, max_tokens=4)
    assert cascading.tokens == one_shot.tokens
    assert_same_cache(cascading, one_shot)


# ----------------------------------------------------------------------------- re-plans and batches


@dataclass
class HalvingPolicy(KVPolicy):
    """Test policy: after layer l, layer m <= l keeps (per head h) entries e with (e + h) % 2^(l - m + 1) == 0.

    The sets are nested as l grows, scattered, and differ per head, so the engine must map every re-plan
    onto entries that earlier compactions already moved.
    """

    name = "halving-test"
    grow_back: bool = False

    @property
    def compresses_layerwise(self) -> bool:
        return True

    def on_layer_prefilled(self, layer: LayerPrefill, state: dict[str, Any]) -> Any:
        assert layer.keys.shape[1] == layer.length == N  # each layer is seen whole
        return None

    def plan_layer(
        self, request: RequestPrefill, layer: int, layer_results: list[Any], state: dict[str, Any]
    ) -> LayerKeep:
        e = torch.arange(request.length)
        masks = []
        for m in range(layer + 1):
            step = 2 ** (layer - m + 1) if not (self.grow_back and layer == 1) else 1
            masks.append(torch.stack([(e + h) % step == 0 for h in range(request.num_kv_heads)]))
        return LayerKeep(list(range(layer + 1)), torch.stack(masks))


def test_replans_of_earlier_layers_land_on_the_right_entries(model_dir: Path) -> None:
    policy = HalvingPolicy()
    result = run(model_dir, policy)
    for layer, (_, _, positions) in enumerate(result.kept):
        step = 2 ** (LAYERS - layer)
        for h in range(HEADS):
            held = positions[h][positions[h] >= 0].tolist()
            assert held == [e for e in range(N) if (e + h) % step == 0]
    assert result.tokens == run(model_dir, "full").tokens  # the first token comes from untouched logits
    # A plan that revives dropped entries is refused; the request fails alone and frees its pages.
    engine = engine_for(model_dir)
    engine.add_request(prompt(), SamplingParams(max_tokens=1, temperature=0.0), policy=HalvingPolicy(grow_back=True))
    outputs = [o for _ in range(20) for o in engine.step() if o.finished]
    assert [o.finish_reason for o in outputs] == ["error"]
    assert "already dropped" in (outputs[0].error or "")
    assert engine.cache.pool.num_used == 0 and not engine.has_unfinished_requests()


def test_a_mixed_batch_matches_solo_runs(model_dir: Path, profile: str) -> None:
    specs: list[Any] = [
        {"name": "xkv", "profile": profile},
        {"name": "lava", "tokens": 40, "window": WINDOW, "cascading": True},
        {"name": "snapkv", "tokens": 24, "window": 8},
        None,
    ]
    ids = [prompt(N - 7 * i, seed=10 + i) for i in range(len(specs))]
    solo = [run(model_dir, spec, ids=p, max_tokens=4) for spec, p in zip(specs, ids, strict=True)]
    engine = engine_for(model_dir, chunk=512)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params, policy=spec) for spec, p in zip(specs, ids, strict=True)]
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for rid, alone in zip(rids, solo, strict=True):
        assert done[rid].output_token_ids == alone.tokens
        assert done[rid].kv.kept_per_head == alone.kept_per_head
    assert engine.cache.pool.num_used == 0


# ----------------------------------------------------------------------------- the bench


def test_bench_prefill_peak_on_a_tiny_model(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_prefill_peak_bench(PrefillPeakConfig(model=str(model_dir), context_len=256))
    by_name = {r["policy"]: r for r in rows}
    assert list(by_name) == ["full", "xkv", "xkv + profile", "lava", "lava cascading"]
    full = by_name["full"]["prefill_peak_bytes"]
    assert full == by_name["full"]["final_bytes"] == by_name["full"]["reserved_bytes"]
    for name in ("xkv", "lava"):  # end of prefill: the whole prompt in every layer first
        assert by_name[name]["prefill_peak_bytes"] == full > by_name[name]["final_bytes"]
    for name in ("xkv + profile", "lava cascading"):
        assert by_name[name]["final_bytes"] < by_name[name]["prefill_peak_bytes"] < full
        # Admission reserves the declared peak (never below the measured one) and takes more requests at once.
        assert by_name[name]["prefill_peak_bytes"] <= by_name[name]["reserved_bytes"] < full
        assert by_name[name]["admitted_at_once"] > by_name["full"]["admitted_at_once"] == 4
    assert by_name["xkv + profile"]["reserved_bytes"] == by_name["xkv + profile"]["prefill_peak_bytes"]
    table = capsys.readouterr().out
    assert "prefill peak" in table and "lava cascading" in table

    assert main(["bench", "prefill-peak", "--model", str(model_dir), "--context-len", "48"]) == 0
    assert "xkv + profile" in capsys.readouterr().out
    assert main(["bench", "prefill-peak", "--model", str(model_dir), "--context-len", "1"]) == 2
    assert "context_len must be >= 2" in capsys.readouterr().err


# ----------------------------------------------------------------------------- admission by the declared peak


def full_pages(n: int = N) -> int:
    return LAYERS * HEADS * pages(n)


@pytest.mark.parametrize("n", [N, 37, 9])
@pytest.mark.parametrize(
    "spec",
    [
        {"name": "lava", "tokens": 40, "window": WINDOW, "cascading": True},
        {"name": "lava", "ratio": 0.3, "window": WINDOW, "cascading": True},
        {"name": "lava", "ratio": 0.05, "window": WINDOW, "cascading": True},  # the window shrinks to the budget
        {"name": "lava", "tokens": 200, "window": WINDOW, "cascading": True},  # keeps everything
    ],
    ids=["tokens", "ratio", "shrunk-window", "everything"],
)
def test_lava_cascading_declares_a_peak_it_never_passes(model_dir: Path, spec: dict[str, Any], n: int) -> None:
    policy = load_policy(spec)
    assert policy is not None
    declared = policy.prefill_peak_pages(n, LAYERS, HEADS, PAGE)
    for seed in (1, 2, 3):  # the bound holds whatever the scores (entropies) turn out to be
        measured = run(model_dir, policy, ids=prompt(n, seed=seed))
        assert measured.peak_pages <= declared <= full_pages(n)
    if spec.get("tokens") == 40 and n == N:
        assert declared < full_pages(n)


def test_xkv_profile_declares_its_exact_peak(model_dir: Path, profile: str) -> None:
    for n in (N, 37, 9):
        for spec in ({"profile": profile}, {"profile": profile, "ratio": 0.3}):
            policy = XKVPolicy(**spec)
            assert run(model_dir, policy, ids=prompt(n)).peak_pages == policy.prefill_peak_pages(n, LAYERS, HEADS, PAGE)
    # Without a profile (end of prefill) and for policies that do not compress layer by layer: the full prompt.
    for other in (XKVPolicy(ratio=0.3), LavaPolicy(ratio=0.3), load_policy("snapkv")):
        assert other is not None and other.prefill_peak_pages(N, LAYERS, HEADS, PAGE) == full_pages()


@pytest.mark.parametrize("layerwise", ["xkv", "lava"])
def test_the_scheduler_admits_by_the_declared_peak(model_dir: Path, profile: str, layerwise: str) -> None:
    """A pool with room for two uncompressed prompts prefills more layer-wise requests at once; same results."""
    spec: dict[str, Any] = (
        {"name": "xkv", "profile": profile}
        if layerwise == "xkv"
        else {"name": "lava", "tokens": 40, "window": WINDOW, "cascading": True}
    )
    ids = [prompt(N, seed=20 + i) for i in range(5)]
    solo = [run(model_dir, spec, ids=p, max_tokens=3) for p in ids]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    def first_step(policy: Any) -> tuple[int, LLMEngine, list[str]]:
        engine = LLMEngine(
            model_dir, dtype=torch.float32, num_pages=2 * full_pages() + 3, page_size=PAGE, max_num_batched_tokens=8 * N
        )
        rids = [engine.add_request(p, params, policy=policy) for p in ids]
        engine.step()
        prefilled = sum(engine.requests[r].seat.num_processed == N for r in rids)
        return prefilled, engine, rids

    conservative, _, _ = first_step(
        EndOfPrefillXKV(profile=profile) if layerwise == "xkv" else {**spec, "cascading": False}
    )
    admitted, engine, rids = first_step(spec)
    assert conservative == 2 and admitted > conservative
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for rid, alone in zip(rids, solo, strict=True):
        assert done[rid].output_token_ids == alone.tokens and done[rid].kv.kept_per_head == alone.kept_per_head
    assert engine.cache.pool.num_used == 0


class UnderDeclaringLava(LavaPolicy):
    """LAVa cascading that declares room for one layer whole and a page: its second layer passes it."""

    def prefill_peak_pages(self, length: int, num_layers: int, num_kv_heads: int, page_size: int) -> int:
        return num_kv_heads * -(-length // page_size) + 1


def test_a_wrong_declaration_fails_that_request_alone(model_dir: Path) -> None:
    liar = UnderDeclaringLava(ratio=None, tokens=40, window=WINDOW, cascading=True)
    honest: list[Any] = [{"name": "lava", "tokens": 40, "window": WINDOW, "cascading": True}, None]
    ids = [prompt(N, seed=30 + i) for i in range(3)]
    solo = [run(model_dir, spec, ids=p, max_tokens=3) for spec, p in zip(honest, ids[1:], strict=True)]
    declared = liar.prefill_peak_pages(N, LAYERS, HEADS, PAGE)
    honest_peak = load_policy(honest[0]).prefill_peak_pages(N, LAYERS, HEADS, PAGE)  # type: ignore[union-attr]
    # Exactly the three reservations: any page the liar took past its own would be another request's.
    engine = LLMEngine(
        model_dir,
        dtype=torch.float32,
        num_pages=declared + honest_peak + full_pages(),
        page_size=PAGE,
        max_num_batched_tokens=4 * N,
    )
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params, policy=spec) for spec, p in zip([liar, *honest], ids, strict=True)]
    done: dict[str, Any] = {}
    first = True
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if first:  # all three were admitted into the first step
            assert all(r in done or engine.requests[r].seat.num_processed > 0 for r in rids)
            first = False
    assert done[rids[0]].finish_reason == "error" and "prefill_peak_pages" in (done[rids[0]].error or "")
    for rid, alone in zip(rids[1:], solo, strict=True):
        assert done[rid].finish_reason != "error"
        assert done[rid].output_token_ids == alone.tokens and done[rid].kv.kept_per_head == alone.kept_per_head
    assert engine.cache.pool.num_used == 0


def test_the_vllm_scheduler_reserves_by_the_same_rule(profile: str) -> None:
    """The plugin's scheduler asks its `PoolReport` (no vLLM needed here): the embedded scheduler's figures."""
    from vllm_kvpress_ext.vllm_plugin.report import PoolReport

    report = PoolReport(1000, 1000, PAGE, LAYERS * HEADS, 64, num_layers=LAYERS, num_kv_heads=HEADS)
    lava = load_policy({"name": "lava", "tokens": 40, "window": WINDOW, "cascading": True})
    assert lava is not None
    declared = lava.prefill_peak_pages(N, LAYERS, HEADS, PAGE)
    assert report.prefill_pages(N, lava, whole_prompt=True) == declared < full_pages()
    assert report.prefill_pages(N, lava, whole_prompt=False) == full_pages()  # chunked: every layer whole first
    assert report.prefill_pages(N, load_policy("snapkv"), whole_prompt=True) == full_pages()
    assert report.prefill_pages(N, None, whole_prompt=True) == full_pages()
    xkv = XKVPolicy(profile=profile)
    assert report.prefill_pages(N, xkv, whole_prompt=True) == xkv.prefill_peak_pages(N, LAYERS, HEADS, PAGE)
    # A report from a worker that does not say its shape: the uncompressed peak, as before.
    assert PoolReport(1000, 1000, PAGE, LAYERS * HEADS, 64).prefill_pages(N, lava, True) == full_pages()
