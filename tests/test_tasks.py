"""Synthetic long-context tasks: determinism, answers re-derived independently, exact lengths, protocols.

The answer checks parse the *text* (records, assignments, item words) with small parsers written here,
independent of the generators' own bookkeeping.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_kvpress_ext.tasks.synthetic import (
    PROTOCOLS,
    TASKS,
    PromptSpec,
    Sample,
    aggregate,
    build_prompt,
    chat_conversation,
    chat_messages,
    generate,
    make,
    score,
    training_example,
)
from vllm_kvpress_ext.tasks.tokenizer import EOS, FILLER_WORDS, ITEM_WORDS, build_tokenizer, save_tokenizer

TOK = build_tokenizer()


def n_tokens(text: str) -> int:
    return len(TOK.encode(text, add_special_tokens=False).ids)


# ---------------------------------------------------------------- independent parsers


def parse_records(context: str) -> list[tuple[str, str]]:
    """``key K... V... .`` records as (key, value) strings, in order of appearance (keys are words, values numbers)."""
    words, out, i = context.split(), [], 0
    while i < len(words):
        if words[i] != "key":
            i += 1
            continue
        k = words.index(".", i)
        j = next(p for p in range(i + 1, k) if words[p].isdigit())
        out.append((" ".join(words[i + 1 : j]), " ".join(words[j:k])))
        i = k + 1
    return out


def between(question: str, start: str, end: str = "?") -> str:
    words = question.split()
    i = words.index(start)
    return " ".join(words[i + 1 : words.index(end, i)])


def resolve_variables(context: str) -> tuple[list[str], dict[str, str]]:
    """Assignment order and each variable's final number, by following ``var X = Y .`` statements."""
    words = context.split()
    order, source = [], {}
    for i, w in enumerate(words):
        if w == "var":
            assert words[i + 2] == "=" and words[i + 4] == "."
            order.append(words[i + 1])
            source[words[i + 1]] = words[i + 3]

    def value(v: str) -> str:
        seen = set()
        while not v.isdigit():
            assert v not in seen, "cycle"
            seen.add(v)
            v = source[v]
        return v

    return order, {v: value(v) for v in order}


def derive_answer(sample: Sample, question: str) -> str:
    """The answer recomputed from the context text alone."""
    ctx, task = sample.context, sample.task
    records = parse_records(ctx)
    if task in ("niah_multikey", "associative_recall"):
        key = between(question, "key")
        matches = [v for k, v in records if k == key]
        assert len(matches) == 1
        return matches[0]
    if task == "niah_multivalue":
        key = between(question, "key")
        return " , ".join(v for k, v in records if k == key)
    if task == "niah_multiquery":
        table = dict(records)
        assert len(table) == len(records)
        return " , ".join(table[k.strip()] for k in between(question, "keys").split(" , "))
    if task == "variable_tracking":
        order, values = resolve_variables(ctx)
        if "variables" in question.split():
            target = between(question, "equal")
            return " , ".join(v for v in order if values[v] == target)
        return values[between(question, "var")]
    if task == "aggregation":
        counts = Counter(w for w in ctx.split() if w in ITEM_WORDS)
        if question.startswith("how many"):
            return str(counts[between(question, "does", "appear")])
        k = int(between(question, "are", "most"))
        ranked = counts.most_common()
        assert len(ranked) == k or ranked[k - 1][1] > ranked[k][1], "top-k must be unambiguous"
        assert len({c for _, c in ranked[:k]}) == k, "top-k counts must be strictly ordered"
        return " , ".join(w for w, _ in ranked[:k])
    raise AssertionError(task)


# ---------------------------------------------------------------- parameter grid

CASES: list[tuple[str, dict[str, Any]]] = [
    ("niah_multikey", {}),
    ("niah_multikey", {"key_length": 2, "value_length": 3, "num_records": 12, "filler": "noise"}),
    ("niah_multikey", {"context_length": None, "num_records": 30, "num_keys": 8, "key_length": 2}),
    ("niah_multivalue", {}),
    ("niah_multivalue", {"key_length": 3, "value_length": 2, "values_per_key": 6, "filler": "noise"}),
    ("niah_multiquery", {}),
    ("niah_multiquery", {"num_queries": 8, "key_length": 2, "context_length": 512, "filler": "noise"}),
    ("variable_tracking", {}),
    ("variable_tracking", {"query": "value", "num_chains": 4, "chain_length": 6, "filler": "noise"}),
    ("variable_tracking", {"context_length": None, "num_chains": 8, "chain_length": 8}),
    ("associative_recall", {}),
    ("associative_recall", {"num_records": 64, "num_keys": 64, "num_values": 64, "key_length": 1}),
    ("associative_recall", {"context_length": 400, "key_length": 2, "value_length": 2, "num_queries": 5}),
    ("aggregation", {}),
    ("aggregation", {"top_k": 3, "num_distinct": 12, "max_count": 9, "filler": "noise", "context_length": 512}),
    ("aggregation", {"query": "count", "context_length": None, "max_count": 20}),
]


@pytest.mark.parametrize(("task", "params"), CASES)
def test_answers_match_an_independent_reading_of_the_context(task: str, params: dict[str, Any]) -> None:
    for seed in range(12):
        sample = generate(task, seed, **params)
        assert sample.task == task
        for one in sample.split_turns():
            assert one.answer == derive_answer(sample, one.question), (seed, one)


@pytest.mark.parametrize(("task", "params"), CASES)
def test_requested_length_is_hit_exactly(task: str, params: dict[str, Any]) -> None:
    length = params.get("context_length", make(task).context_length)  # type: ignore[attr-defined]
    for seed in range(5):
        sample = generate(task, seed, **params)
        if length is None:
            assert all(w not in FILLER_WORDS for w in sample.context.split())  # no filler at all
        else:
            assert n_tokens(sample.prompt) == length
        assert n_tokens(sample.context) == sample.metadata["num_context_tokens"]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    length=st.integers(60, 900),
    records=st.integers(1, 9),
    key_length=st.integers(1, 3),
    value_length=st.integers(1, 3),
    filler=st.sampled_from(["random", "noise"]),
    depth=st.one_of(st.none(), st.floats(0.0, 1.0)),
)
def test_multikey_property(
    seed: int, length: int, records: int, key_length: int, value_length: int, filler: str, depth: float | None
) -> None:
    params = {"num_records": records, "key_length": key_length, "value_length": value_length}
    needed = records * (key_length + value_length + 2) + key_length + 6
    if needed > length:
        with pytest.raises(ValueError, match="too short"):
            generate("niah_multikey", seed, context_length=length, **params)
        return
    sample = generate("niah_multikey", seed, context_length=length, filler=filler, depth=depth, **params)
    assert n_tokens(sample.prompt) == length
    assert sample.answer == derive_answer(sample, sample.question)
    (start, end), words = sample.metadata["evidence"][0], sample.context.split()
    assert (
        words[start] == "key"
        and words[end - 1] == "."
        and " ".join(words[end - 1 - value_length : end - 1]) == (sample.answer)
    )


def test_same_seed_same_sample_and_different_seeds_differ() -> None:
    for task in TASKS:
        first = [generate(task, seed, context_length=256) for seed in range(6)]
        again = [generate(task, seed, context_length=256) for seed in range(6)]
        assert first == again
        assert len({(s.context, s.question) for s in first}) == 6
        rng_sample = make(task, context_length=256).sample(random.Random(3))
        assert (rng_sample.context, rng_sample.question, rng_sample.answer) == (
            first[3].context,
            first[3].question,
            first[3].answer,
        )


@pytest.mark.parametrize(("task", "params"), [c for c in CASES if c[0] != "aggregation"])
def test_minimum_length_check_is_tight(task: str, params: dict[str, Any]) -> None:
    """The up-front "too short" check accepts exactly the no-filler length and rejects one less."""
    shortest = n_tokens(generate(task, 0, **{**params, "context_length": None}).prompt)
    assert n_tokens(generate(task, 1, **{**params, "context_length": shortest}).prompt) == shortest
    with pytest.raises(ValueError, match="too short"):
        make(task, **{**params, "context_length": shortest - 1})


def test_aggregation_length_check_covers_the_largest_draw() -> None:
    params = {"num_distinct": 10, "top_k": 2, "max_count": 7, "distractor_max_count": 3}
    largest = (7 + 6) + 8 * 3 + 9  # top counts 7 and 6, eight distractors at 3, the question
    generate("aggregation", 0, context_length=largest, **params)
    with pytest.raises(ValueError, match="too short"):
        make("aggregation", context_length=largest - 1, **params)


def test_samples_do_not_depend_on_the_process() -> None:
    """Another interpreter with a different hash seed draws the same samples (no set-order dependence)."""
    code = (
        "import json; from vllm_kvpress_ext.tasks.synthetic import TASKS, generate; "
        "print(json.dumps([generate(t, 7, context_length=300, filler='noise').to_dict() for t in TASKS]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "123"}
    )
    here = [generate(t, 7, context_length=300, filler="noise").to_dict() for t in TASKS]
    assert json.loads(out.stdout) == json.loads(json.dumps(here))


def test_golden_sample_pins_the_generator() -> None:
    """Changing this output changes every dataset and trained checkpoint: do it on purpose only."""
    sample = generate("niah_multikey", 0, context_length=None, num_records=3)
    assert sample.context == "key snail 33 . key trout 65 . key clam 62 ."
    assert (sample.question, sample.answer) == ("what is key trout ? answer :", "65")


def test_depth_places_the_needle() -> None:
    for depth in (0.0, 0.25, 0.5, 1.0):
        for seed in range(5):
            sample = generate("niah_multikey", seed, context_length=1000, num_records=6, depth=depth)
            words = sample.context.split()
            start = sample.metadata["evidence"][0][0]
            n_filler = sum(w in FILLER_WORDS for w in words)
            filler_before = sum(w in FILLER_WORDS for w in words[:start])
            assert abs(filler_before - depth * n_filler) <= 0.5


def test_sample_serialises_and_splits_turns() -> None:
    sample = generate("associative_recall", 1, num_records=5)
    assert Sample.from_dict(json.loads(json.dumps(sample.to_dict()))) == sample
    turns = sample.split_turns()
    assert len(turns) == 5 == len(sample.turns)
    assert (turns[0].question, turns[0].answer) == (sample.question, sample.answer)
    assert len({t.question for t in turns}) == 5
    single = generate("niah_multikey", 1)
    assert single.split_turns() == [single] and single.turns == [(single.question, single.answer)]


# ---------------------------------------------------------------- protocols and scoring


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("chat", [True, False])
def test_build_prompt_split_points(task: str, chat: bool) -> None:
    sample = generate(task, 5, context_length=200)
    specs = {p: build_prompt(sample, TOK, p, chat=chat) for p in PROTOCOLS}
    ids = specs["served"].token_ids
    assert all(s.token_ids == ids for s in specs.values())
    expected = TOK.encode(f"<|user|> {sample.prompt} <|assistant|>" if chat else sample.prompt).ids
    assert ids == expected

    head = 2 if chat else 1
    served, strict, agnostic = (specs[p].compress_after for p in ("served", "strict", "agnostic"))
    assert served == len(ids)
    assert TOK.decode(ids[head:agnostic]) == sample.context
    assert TOK.decode(ids[agnostic:]) == sample.question  # the question starts right at the split
    assert agnostic < strict < served
    cue = TOK.decode(ids[strict:], skip_special_tokens=False)
    assert cue == ("answer : <|assistant|>" if chat else "answer :")

    spec = specs["strict"]
    assert TOK.decode(spec.answer_ids) == sample.answer and spec.max_new_tokens == len(spec.answer_ids) + 1
    for start, end in spec.evidence:  # evidence spans point at context tokens
        assert head <= start < end <= agnostic


def test_build_prompt_evidence_holds_the_answer() -> None:
    sample = generate("niah_multikey", 2, context_length=300, key_length=2, value_length=2)
    spec = build_prompt(sample, protocol="strict")
    [(start, end)] = spec.evidence
    assert TOK.decode(spec.token_ids[start:end]).endswith(f"{sample.metadata['query_key']} {sample.answer} .")


def test_build_prompt_matches_hf_chat_template(tmp_path: Any) -> None:
    from vllm_kvpress_ext.tasks.tokenizer import load_tokenizer

    hf = load_tokenizer(save_tokenizer(tmp_path))
    for task in TASKS:
        sample = generate(task, 0, context_length=150)
        spec = build_prompt(sample, hf, "agnostic")
        assert spec.token_ids == hf.apply_chat_template(
            chat_messages(sample), add_generation_prompt=True, return_dict=False
        )
        assert spec == build_prompt(sample, TOK, "agnostic")
        example = training_example(sample, hf)
        assert example.token_ids == hf.apply_chat_template(chat_conversation(sample), return_dict=False)


def test_score_exact_match() -> None:
    sample = generate("niah_multivalue", 0, context_length=128)
    spec = build_prompt(sample, protocol="strict")
    eos = TOK.token_to_id(EOS)
    assert score(sample, sample.answer)
    assert score(sample, f"  {sample.answer} <eos> junk")
    assert score(sample, f"{sample.answer}\nmore text")
    assert not score(sample, sample.answer.split()[0])  # partial
    assert not score(sample, f"{sample.answer} , 1")  # extra item
    assert not score(sample, "")
    assert score(spec, [*spec.answer_ids, eos, 5, 6])
    assert score(spec, spec.answer_ids)
    assert not score(spec, [*spec.answer_ids[:-1], eos])
    assert score(sample, [*spec.answer_ids, eos])  # ids against a Sample are decoded
    assert score(spec, sample.answer + " <eos>")


def test_aggregate() -> None:
    results = [("a", True), ("a", False), ("a", True), ("a", True), ("b", False)]
    out = aggregate(results)
    assert out == {"a": 0.75, "b": 0.0, "all": 0.6, "macro": 0.375}
    assert aggregate([]) == {}


def test_training_example_marks_answers_and_eos() -> None:
    sample = generate("associative_recall", 4, num_records=6)
    for chat in (True, False):
        ex = training_example(sample, chat=chat)
        assert len(ex.answer_spans) == 6
        for (start, end), (_, answer) in zip(ex.answer_spans, sample.turns, strict=True):
            assert TOK.decode(ex.token_ids[start:end], skip_special_tokens=False) == f"{answer} <eos>"
        labels = ex.labels()
        assert sum(label != -100 for label in labels) == sum(e - s for s, e in ex.answer_spans)
        # The first turn is exactly the evaluation prompt followed by the answer.
        spec = build_prompt(sample, chat=chat)
        assert ex.token_ids[: len(spec.token_ids)] == spec.token_ids
        assert ex.answer_spans[0][0] == len(spec.token_ids)
    first_only = training_example(sample, all_turns=False)
    assert len(first_only.answer_spans) == 1


# ---------------------------------------------------------------- parameter errors


@pytest.mark.parametrize(
    ("task", "params", "match"),
    [
        ("niah_multikey", {"num_records": 9, "num_keys": 8}, "distinct keys"),
        ("niah_multikey", {"num_records": 20, "num_keys": 4, "key_length": 2}, "distinct keys"),
        ("niah_multikey", {"num_records": 11, "num_values": 10}, "distinct values"),
        ("niah_multikey", {"num_records": 40, "context_length": 100}, "too short"),
        ("niah_multikey", {"depth": 1.5}, "depth"),
        ("niah_multikey", {"num_records": 0}, "num_records"),
        ("niah_multikey", {"num_keys": 500}, "num_keys"),
        ("niah_multikey", {"filler": "essay"}, "filler"),
        ("niah_multikey", {"key_length": 1.5}, "key_length"),
        ("niah_multikey", {"context_lenght": 100}, "valid parameters"),
        ("niah_multivalue", {"values_per_key": 20, "num_values": 10}, "distinct values"),
        ("niah_multiquery", {"num_queries": 9, "num_records": 8}, "num_queries"),
        ("variable_tracking", {"num_chains": 9, "chain_length": 8}, "distinct variables"),
        ("variable_tracking", {"query": "sum"}, "query"),
        ("variable_tracking", {"context_length": 30}, "too short"),
        ("associative_recall", {"num_records": 65}, "distinct keys"),
        ("associative_recall", {"num_queries": 17}, "num_queries"),
        ("aggregation", {"top_k": 5, "max_count": 6, "distractor_max_count": 2}, "distinct counts"),
        ("aggregation", {"num_distinct": 40, "max_count": 9, "context_length": 95}, "too short"),
        ("aggregation", {"max_count": 100}, "max_count"),
        ("essay_qa", {}, "unknown task"),
    ],
)
def test_bad_parameters_raise_clear_errors(task: str, params: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        generate(task, 0, **params)


def test_bad_protocol_and_question_raise() -> None:
    sample = generate("niah_multikey", 0)
    with pytest.raises(ValueError, match="protocol"):
        build_prompt(sample, protocol="lazy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="answer cue"):
        build_prompt(Sample("x", sample.context, "what is key fox ?", "1"))
    assert isinstance(build_prompt(sample), PromptSpec)
