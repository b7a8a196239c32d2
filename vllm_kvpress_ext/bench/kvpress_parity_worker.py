"""The NVIDIA kvpress side of `kvpress bench kvpress-parity`: a script run by the kvpress venv's Python.

Never imported by this package (kvpress needs an older transformers than this project): the bench
starts it as `PYTHON kvpress_parity_worker.py REQUEST.json RESULT.json` and it needs only the standard
library, torch, transformers and kvpress.

Request (JSON): `model_dir` (an HF directory with the same fp32 weights the project runs), `stop_ids`,
`accuracy` (whether to answer the questions), `prompts` (each `id`, `context_ids`, `question_ids`,
`max_new_tokens`) and `runs` (each `id`, `press` in snapkv / streaming_llm / pyramidkv / adakv /
expected_attention / kvzip / full, `compression_ratio` and the press's settings: `window_size`,
`kernel_size`, `n_sink`, `beta`, `alpha_safeguard`, `chunk_size`, ...).

Result (JSON): `versions`, and one item per (prompt, run): `prompt`, `run`, `answer` (null without
`accuracy`), `seconds`, `shape` [L, H, n] and `kept`, the kept (layer, KV head, position) set as a
bit mask (numpy `packbits` of the bool `[L, H, n]` array, little bit order, base64); null for `full`.

How the kept sets are read, without changing what the press does:
- Score-based presses (SnapKV, StreamingLLM, PyramidKV) keep the top-`n_kept` scores of each head.
  The press's `score` is wrapped to see the scores it returns, and the same top-k is taken on them
  with the press's own budget (`kvpress.utils.compute_n_kept`, or PyramidKV's `get_layer_budget`).
- AdaKV keeps every entry in the cache and masks the pruned ones in attention; after its `compress`
  the pruned (batch, head, position) triples are on the attention module (`masked_key_indices`).
- KVzip does the same, for every layer at once, in `compress_post` after its reconstruction passes.
Protocol: the pipeline's own `_forward` (context prefilled under the press, then the question
prefilled and greedy decoding), fed with the bench's token ids instead of its chat template. PyramidKV
leaves layers of different lengths, and transformers' SDPA path then builds a question mask of the
first layer's width for every layer (a shape error); for it the question is fed one token at a time
(a one-token step needs no mask) and the answer decoded greedily the same way: the same attention,
the same positions (context length + i), the same stop tokens.
"""

from __future__ import annotations

import base64
import json
import sys
import time
from typing import Any


def _pack(mask: Any) -> str:
    import numpy as np

    bits = np.packbits(mask.cpu().numpy().astype(bool).reshape(-1), bitorder="little")
    return base64.b64encode(bits.tobytes()).decode("ascii")


def _press(run: dict[str, Any]) -> Any:
    from kvpress import (
        AdaKVPress,
        ExpectedAttentionPress,
        KVzipPress,
        PyramidKVPress,
        SnapKVPress,
        StreamingLLMPress,
    )

    kind, ratio = run["press"], float(run["compression_ratio"])
    if kind == "snapkv":
        return SnapKVPress(compression_ratio=ratio, window_size=run["window_size"], kernel_size=run["kernel_size"])
    if kind == "streaming_llm":
        return StreamingLLMPress(compression_ratio=ratio, n_sink=run["n_sink"])
    if kind == "pyramidkv":
        return PyramidKVPress(
            compression_ratio=ratio, window_size=run["window_size"], kernel_size=run["kernel_size"], beta=run["beta"]
        )
    if kind == "adakv":
        inner = SnapKVPress(compression_ratio=ratio, window_size=run["window_size"], kernel_size=run["kernel_size"])
        return AdaKVPress(inner, alpha_safeguard=run["alpha_safeguard"])
    if kind == "expected_attention":
        return ExpectedAttentionPress(
            compression_ratio=ratio,
            n_future_positions=run["n_future_positions"],
            n_sink=run["n_sink"],
            use_covariance=run["use_covariance"],
            use_vnorm=run["use_vnorm"],
        )
    if kind == "kvzip":
        return KVzipPress(compression_ratio=ratio, n_sink=run["n_sink"], chunk_size=run["chunk_size"])
    raise ValueError(f"unknown press {kind!r}")


def _record(press: Any, kind: str, kept: dict[int, Any]) -> None:
    """Wrap the press so that every layer's kept set lands in `kept[layer]` (bool `[H, n]`)."""
    import torch
    from kvpress.utils import compute_n_kept

    if kind == "kvzip":
        compress_post = press.compress_post

        def compress_post_and_record(model: Any) -> None:
            compress_post(model)
            n = press.score_val.shape[-1]
            for layer in model.model.layers:
                module = layer.self_attn
                mask = torch.ones(model.config.num_key_value_heads, n, dtype=torch.bool)
                _, heads, positions = module.masked_key_indices
                mask[heads.cpu(), positions.cpu()] = False
                kept[module.layer_idx] = mask

        press.compress_post = compress_post_and_record
        return
    if kind == "adakv":
        compress = press.compress

        def compress_and_record(module: Any, hidden_states: Any, keys: Any, values: Any, attentions: Any, kwargs: Any):  # type: ignore[no-untyped-def]
            out = compress(module, hidden_states, keys, values, attentions, kwargs)
            mask = torch.ones(keys.shape[1], keys.shape[2], dtype=torch.bool)
            _, heads, positions = module.masked_key_indices
            mask[heads.cpu(), positions.cpu()] = False
            kept[module.layer_idx] = mask
            return out

        press.compress = compress_and_record
        return
    score = press.score

    def score_and_record(module: Any, hidden_states: Any, keys: Any, values: Any, attentions: Any, kwargs: Any):  # type: ignore[no-untyped-def]
        scores = score(module, hidden_states, keys, values, attentions, kwargs)
        k_len = keys.shape[2]
        if kind == "pyramidkv":
            n_kept = press.get_layer_budget(module, k_len)
        else:
            n_kept = compute_n_kept(k_len, press.compression_ratio)
        indices = scores.topk(n_kept, dim=-1).indices[0]  # the call the press makes next, on the same scores
        mask = torch.zeros(keys.shape[1], k_len, dtype=torch.bool)
        mask.scatter_(-1, indices.cpu(), True)
        kept[module.layer_idx] = mask
        return scores

    press.score = score_and_record


def _stepwise_answer(model: Any, tokenizer: Any, press: Any, context: Any, question: Any, max_new: int) -> str:
    """Context under the press, then question and answer one token per forward pass (see the docstring)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with press(model):
        model.model(input_ids=context, past_key_values=cache)
    position = context.shape[1]
    logits = None
    for token in question[0].tolist():
        ids, pos = torch.tensor([[token]]), torch.tensor([[position]])
        logits = model(input_ids=ids, past_key_values=cache, position_ids=pos).logits
        position += 1
    assert logits is not None
    stops = set(model.generation_config.eos_token_id)
    generated = [int(logits[0, -1].argmax())]
    while len(generated) < max_new and generated[-1] not in stops:
        ids, pos = torch.tensor([[generated[-1]]]), torch.tensor([[position]])
        logits = model(input_ids=ids, past_key_values=cache, position_ids=pos).logits
        position += 1
        generated.append(int(logits[0, -1].argmax()))
    return str(tokenizer.decode(generated, skip_special_tokens=True))


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: kvpress_parity_worker.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        request = json.loads(f.read())

    import kvpress
    import torch
    import transformers
    from kvpress.pipeline import KVPressTextGenerationPipeline
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        request["model_dir"], dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    model.generation_config.eos_token_id = list(request["stop_ids"])
    tokenizer = AutoTokenizer.from_pretrained(request["model_dir"])
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    results = []
    total = len(request["prompts"]) * len(request["runs"])
    for p_index, prompt in enumerate(request["prompts"]):
        context = torch.tensor([prompt["context_ids"]])
        question = torch.tensor([prompt["question_ids"]])
        for r_index, run in enumerate(request["runs"]):
            t0 = time.perf_counter()
            press = None if run["press"] == "full" else _press(run)
            kept: dict[int, Any] = {}
            if press is not None:
                _record(press, run["press"], kept)
            answer = None
            with torch.no_grad():
                if request["accuracy"] and run["press"] == "pyramidkv":
                    answer = _stepwise_answer(model, tokenizer, press, context, question, prompt["max_new_tokens"])
                elif request["accuracy"]:
                    inputs = {"context_ids": context, "questions_ids": [question]}
                    answer = pipe._forward(inputs, max_new_tokens=prompt["max_new_tokens"], press=press)[0]
                elif press is not None:
                    with press(model):
                        model.model(input_ids=context, past_key_values=DynamicCache())
            item: dict[str, Any] = {
                "prompt": prompt["id"],
                "run": run["id"],
                "answer": answer,
                "seconds": time.perf_counter() - t0,
                "shape": None,
                "kept": None,
            }
            if press is not None:
                layers = [kept[layer] for layer in sorted(kept)]
                stacked = torch.stack(layers)
                item["shape"] = list(stacked.shape)
                item["kept"] = _pack(stacked)
            results.append(item)
            done = p_index * len(request["runs"]) + r_index + 1
            print(f"kvpress worker: {done}/{total} {run['id']} on {prompt['id']}", file=sys.stderr, flush=True)
    versions = {"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else _version("kvpress")}
    versions |= {"transformers": transformers.__version__, "torch": torch.__version__}
    with open(argv[2], "w") as f:
        json.dump({"versions": versions, "results": results}, f)
    return 0


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
