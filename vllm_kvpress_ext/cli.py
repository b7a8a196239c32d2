"""The `kvpress` command line.

Sub-commands import their heavy modules lazily so that `kvpress --help` stays instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from vllm_kvpress_ext import __version__
from vllm_kvpress_ext.cli_models import add_models_parser, resolve_model_arg

Handler = Callable[[argparse.Namespace], int]


def _cmd_info(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.utils.env import environment_report

    print(environment_report())
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.cache.demo import run_demo

    run_demo(num_requests=args.requests, prompt_len=args.prompt_len, keep_ratio=args.keep_ratio)
    return 0


def _cmd_policies(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.report import format_table
    from vllm_kvpress_ext.policies import create_policy, policy_class, policy_names

    rows = []
    for name in policy_names():
        defaults = ", ".join(f"{k}={v}" for k, v in create_policy(name).params().items()) or "-"
        rows.append([name, policy_class(name).summary, defaults])
    print(format_table(["policy", "what it does", "defaults"], rows))
    return 0


def _cmd_bench_cache(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.cache_bench import CacheBenchConfig, run_cache_bench

    config = CacheBenchConfig(
        num_requests=args.requests,
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        page_size=args.page_size,
        prompt_len=args.prompt_len,
        decode_steps=args.steps,
        keep_ratio=args.keep_ratio,
    )
    run_cache_bench(config)
    return 0


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _cmd_bench_throughput(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.throughput import ThroughputConfig, run_throughput_bench

    run_throughput_bench(
        ThroughputConfig(
            model=args.model,
            batch_sizes=args.batch_sizes,
            prompt_lens=args.prompt_lens,
            decode_steps=args.decode_steps,
            repeats=args.repeats,
            kv_policy=args.kv_policy,
            device=args.device,
            dtype=args.dtype,
        )
    )
    return 0


def _cmd_bench_capacity(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.capacity import CapacityConfig, run_capacity_bench

    run_capacity_bench(
        CapacityConfig(
            model=args.model,
            shape=args.shape,
            policies=tuple(args.policies.split(",")),
            ratio=args.ratio,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            requests=args.requests,
            kv_memory=args.kv_memory,
            max_num_batched_tokens=args.max_num_batched_tokens,
            device=args.device,
            dtype=args.dtype,
        )
    )
    return 0


def _cmd_bench_policies(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.policies_bench import PoliciesBenchConfig, run_policies_bench

    run_policies_bench(
        PoliciesBenchConfig(
            model=args.model,
            policies=tuple(args.policies.split(",")) if args.policies else (),
            prompt_lens=args.prompt_lens,
            decode_steps=args.decode_steps,
            device=args.device,
            dtype=args.dtype,
        )
    )
    return 0


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _cmd_bench_accuracy(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.accuracy import AccuracyConfig, run_accuracy_bench

    if args.model is None:
        from vllm_kvpress_ext.assets import default_model_dir

        try:
            args.model = str(default_model_dir())
        except FileNotFoundError as err:
            print(f"kvpress bench accuracy: {err}", file=sys.stderr)
            return 2
    else:
        args.model, ok = resolve_model_arg(args.model, "kvpress bench accuracy")
        if not ok:
            return 1
        if not (Path(args.model) / "config.json").is_file() and Path(args.model).suffix.lower() != ".gguf":
            print(
                f"kvpress bench accuracy: {args.model} is not a model directory (no config.json) nor a .gguf file",
                file=sys.stderr,
            )
            return 2
    from vllm_kvpress_ext.bench.natural_accuracy import natural_config, run_natural_accuracy, uses_suite_tokenizer

    if args.suite == "natural" or (args.suite == "auto" and not uses_suite_tokenizer(args.model)):
        try:
            run_natural_accuracy(natural_config(args.model, args))
        except ValueError as err:
            print(f"kvpress bench accuracy: {err}", file=sys.stderr)
            return 2
        return 0
    if args.quick:
        config = AccuracyConfig.quick(args.model, out_dir=args.out or "runs/accuracy-quick")
    else:
        config = AccuracyConfig(model=args.model, out_dir=args.out or "runs/accuracy")
    overrides = {
        "policies": tuple(args.policies.split(",")) if args.policies else None,
        "budgets": args.budgets,
        "tasks": tuple(args.tasks.split(",")) if args.tasks else None,
        "protocol": args.protocol,
        "samples": args.samples,
        "context_len": args.context_len,
    }
    try:
        overrides["task_params"] = _task_params_arg(args.task_param) or None
    except ValueError as err:
        print(f"kvpress bench accuracy: {err}", file=sys.stderr)
        return 2
    config = dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})
    try:
        run_accuracy_bench(config)
    except ValueError as err:
        print(f"kvpress bench accuracy: {err}", file=sys.stderr)
        return 2
    return 0


def _profile_error(message: str) -> int:
    print(f"kvpress profile xkv: {message}", file=sys.stderr)
    return 2


def _cmd_profile_xkv(args: argparse.Namespace) -> int:
    """Sample suite prompts (training seeds), run XKV's R_avg mode on each, save the mean per-layer fractions.

    Arguments are checked before any model is loaded so that a typo costs nothing. Without --model
    the random-weight suite bench model is profiled (loudly: its fractions describe noise).
    """
    import tempfile

    from vllm_kvpress_ext.bench.accuracy import DEFAULT_TASKS, HELD_OUT_SEED
    from vllm_kvpress_ext.bench.tasks import TASKS

    tasks = DEFAULT_TASKS if args.tasks is None else tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    unknown = [t for t in tasks if t not in TASKS]
    if not tasks or unknown:
        return _profile_error(
            f"unknown task(s) {', '.join(unknown) or repr(args.tasks)}; known: {', '.join(sorted(TASKS))}"
        )
    if args.samples < 1:
        return _profile_error(f"--samples must be >= 1, got {args.samples}")
    if args.context_len < 1:
        return _profile_error(f"--context-len must be >= 1, got {args.context_len}")
    if not 0.0 < args.budget <= 1.0:
        return _profile_error(f"--budget (the R_avg coverage target) must lie in (0, 1], got {args.budget}")
    if args.seed < 0 or args.seed + args.samples > HELD_OUT_SEED:
        return _profile_error(
            f"seeds {args.seed}..{args.seed + args.samples - 1} are not all training seeds: profiles must not "
            f"see the held-out evaluation samples (seeds >= {HELD_OUT_SEED})"
        )
    if Path(args.out).is_dir():
        return _profile_error(
            f"--out {args.out} is a directory; give the profile's file name, e.g. {args.out}/xkv.yaml"
        )
    if args.model is not None:
        return _profile_xkv(args, Path(args.model), tasks, str(args.model))
    from vllm_kvpress_ext.bench.models import suite_bench_model_dir

    print(
        "kvpress profile xkv: no --model: profiling the RANDOM-WEIGHT suite bench model (seed 0); its fractions "
        "describe noise, use them only to try the command (or with `kvpress serve --random-model`).",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory(prefix="kvpress-profile-model-") as tmp:
        return _profile_xkv(args, suite_bench_model_dir(tmp), tasks, "random suite bench model (seed 0)")


def _profile_xkv(args: argparse.Namespace, model_dir: Path, tasks: tuple[str, ...], model_label: str) -> int:
    from vllm_kvpress_ext.bench.report import format_table
    from vllm_kvpress_ext.bench.tasks import build_prompt, generate
    from vllm_kvpress_ext.bench.tokenizer import load_tokenizer
    from vllm_kvpress_ext.models.loader import load_config
    from vllm_kvpress_ext.policies.xkv import profile_xkv

    try:
        config = load_config(model_dir)
    except (ValueError, OSError) as exc:
        return _profile_error(f"--model: {exc}")
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return _profile_error(
            f"--model: {model_dir} has no tokenizer; profiling samples the synthetic suite and needs its tokenizer"
        )
    tokenizer = load_tokenizer(model_dir)
    prompts: list[list[int]] = []
    try:
        for task in tasks:
            for i in range(args.samples):
                sample = generate(task, args.seed + i, context_length=args.context_len)
                spec = build_prompt(sample, tokenizer, args.protocol)
                # What the policy sees under this protocol: the tokens prefilled before compression.
                prompts.append(spec.token_ids[: spec.compress_after])
    except ValueError as exc:
        return _profile_error(f"cannot build the prompts: {exc}")
    longest = max(len(p) for p in prompts)
    if longest >= config.max_position_embeddings:
        return _profile_error(
            f"prompts reach {longest} tokens but the model takes {config.max_position_embeddings} positions; "
            "lower --context-len"
        )
    # A pool for the requests run at once, not the engine's 1 GiB default (profiling runs beside other jobs).
    max_seqs = min(len(prompts), 16)
    page_size = 16
    pages = config.num_hidden_layers * config.num_key_value_heads * -(-(longest + 1) // page_size)
    print(f"profiling XKV on {len(prompts)} prompts ({', '.join(tasks)}) of {model_label}...", file=sys.stderr)
    try:
        profile = profile_xkv(
            model_dir,
            prompts,
            target_ratio=args.budget,
            dtype=args.dtype,
            device=args.device,
            num_pages=pages * max_seqs,
            page_size=page_size,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max(2048, longest + 64),
        )
    except ValueError as exc:
        return _profile_error(str(exc))
    profile.metadata.update(
        {
            "model": model_label,
            "tasks": list(tasks),
            "samples_per_task": args.samples,
            "seeds": [args.seed, args.seed + args.samples - 1],
            "context_len": args.context_len,
            "protocol": args.protocol,
            "mean_fraction": sum(profile.fractions) / profile.num_layers,
        }
    )
    path = profile.save(args.out)
    total = sum(profile.fractions)
    rows = [
        [layer, f"{f:.4f}", f"{100 * f / total:.1f}%" if total else "-"] for layer, f in enumerate(profile.fractions)
    ]
    print(format_table(["layer", "fraction kept", "share of kept"], rows))
    print(
        f"mean fraction {total / profile.num_layers:.4f} over {profile.metadata['requests']} request(s) "
        f"(R_avg target {args.budget:g}, protocol {args.protocol})"
    )
    print(f"wrote {path}")
    print(f'use it: kv_policy {{"name": "xkv", "profile": "{path.resolve()}"}}, or a preset YAML with those two keys')
    return 0


def _task_weights(text: str) -> dict[str, float]:
    weights: dict[str, float] = {}
    for item in text.split(","):
        name, _, weight = item.partition(":")
        try:
            weights[name.strip()] = float(weight) if weight else 1.0
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected name:weight, got {item!r}") from None
    return weights


def _cmd_train_model(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.train.model import TrainConfig, train

    try:
        task_params = _task_params_arg(args.task_param)
    except ValueError as err:
        print(f"kvpress train-model: {err}", file=sys.stderr)
        return 2
    config = TrainConfig(
        out=args.out,
        steps=args.steps,
        batch_size=args.batch_size,
        context_len=args.context_len,
        curriculum=args.curriculum,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        rope_theta=args.rope_theta,
        init_std=args.init_std,
        lr=args.lr,
        warmup=args.warmup,
        final_share=args.final_share,
        eval_every=args.eval_every,
        eval_samples=args.eval_samples,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        threads=args.threads,
        init_from=args.init_from,
        stop_after=args.stop_after,
        task_params=task_params,
        **({"tasks": args.tasks} if args.tasks else {}),
    )
    try:
        model_dir = train(config, resume=args.resume)
    except ValueError as err:
        print(f"kvpress train-model: {err}", file=sys.stderr)
        return 2
    print(f"model written to {model_dir}")
    return 0


def _task_params_arg(items: list[str] | None) -> dict[str, dict[str, Any]]:
    """`TASK.PARAM=VALUE` items (values parsed as YAML scalars) -> {task: {param: value}}."""
    import yaml

    params: dict[str, dict[str, Any]] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        task, dot, key = name.partition(".")
        if not (sep and dot and task and key):
            raise ValueError(f"--task-param wants TASK.PARAM=VALUE, got {item!r}")
        params.setdefault(task, {})[key] = yaml.safe_load(value)
    return params


def _cmd_train_gate(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.report import format_table
    from vllm_kvpress_ext.models.write_gate import default_gate_path
    from vllm_kvpress_ext.train.gate import GateTrainConfig, admitted_heatmap, train_gates

    out = args.out if args.out is not None else str(default_gate_path(args.model_dir))
    config = GateTrainConfig(
        model_dir=args.model_dir,
        out=out,
        lam=args.lam,
        local_window=args.local_window,
        tau=args.tau,
        steps=args.steps,
        batch_size=args.batch_size,
        context_len=args.context_len,
        lr=args.lr,
        init_bias=args.init_bias,
        eval_samples=args.eval_samples,
        seed=args.seed,
        threads=args.threads,
        **({"tasks": args.tasks} if args.tasks else {}),
    )
    try:
        path, summary = train_gates(config)
    except (ValueError, FileNotFoundError) as err:
        print(f"kvpress train-gate: {err}", file=sys.stderr)
        return 2
    fractions = summary["admitted_per_layer_head"]
    headers = ["layer", *(f"head {h}" for h in range(len(fractions[0]))), "mean"]
    rows = [
        [str(layer), *(f"{x:.3f}" for x in row), f"{sum(row) / len(row):.3f}"] for layer, row in enumerate(fractions)
    ]
    print(format_table(headers, rows))
    print(
        f"gates written to {path}: loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, "
        f"admitted {summary['admitted_fraction']:.1%} at tau {config.tau} (held-out samples), "
        f"{summary['train_seconds']:.0f} s, {summary['parameters']} gate parameters"
    )
    plot = admitted_heatmap(
        fractions, Path(path).with_suffix(".png"), f"admitted fraction, lambda {config.lam}, W {config.local_window}"
    )
    if plot is not None:
        print(f"heatmap: {plot}")
    return 0


def _size(text: str) -> int:
    from vllm_kvpress_ext.server.config import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low` (a usage error otherwise, not a traceback later)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _port(text: str) -> int:
    value = _at_least(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port lies in [1, 65535], got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must lie in [0, 3600] seconds, got {text}")
    return value


def _policy_names(text: str) -> tuple[str, ...]:
    from vllm_kvpress_ext.policies import policy_names

    names = tuple(p for p in text.split(",") if p)
    unknown = [n for n in names if n not in policy_names()]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(unknown) or '(none given)'}; known: {', '.join(policy_names())}"
        )
    return names


def _cmd_serve(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.server.config import ModelDirError, ServerConfig, resolve_model_dir

    if args.random_model:
        if args.model_dir is not None:
            print("kvpress serve: give MODEL_DIR or --random-model, not both", file=sys.stderr)
            return 2
        import tempfile

        from vllm_kvpress_ext.bench.models import suite_bench_model_dir

        args.model_dir = suite_bench_model_dir(Path(tempfile.mkdtemp(prefix="kvpress-random-model-")))
        args.served_model_name = args.served_model_name or "random-model"
        print(
            f"kvpress serve: serving a RANDOM-WEIGHT model ({args.model_dir}): its text is noise; the API, the "
            "compression and the KV figures are real.",
            file=sys.stderr,
        )
    requested = args.model_dir
    args.model_dir, ok = resolve_model_arg(args.model_dir, "kvpress serve")
    if not ok:
        return 1
    if args.model_dir != requested:  # a catalog name: clients send that name, not the cached file's
        args.served_model_name = args.served_model_name or requested
    try:
        model_dir = resolve_model_dir(args.model_dir)
    except ModelDirError as exc:
        print(f"kvpress serve: {exc}", file=sys.stderr)
        return 2
    from vllm_kvpress_ext.policies import PolicyConfigError, load_policy

    try:
        load_policy(args.kv_policy)  # fail before loading the model
    except PolicyConfigError as exc:
        print(f"kvpress serve: --kv-policy: {exc}", file=sys.stderr)
        return 2
    if str(args.device).startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(f"kvpress serve: --device {args.device}: CUDA is not available on this machine", file=sys.stderr)
            return 2
    from vllm_kvpress_ext.policies import PolicyFiles, set_allowed_files

    try:
        set_allowed_files(PolicyFiles.parse(args.policy_file or ()))
    except ValueError as exc:
        print(f"kvpress serve: --policy-file: {exc}", file=sys.stderr)
        return 2
    config = ServerConfig(
        model_dir=model_dir,
        served_model_name=args.served_model_name,
        kv_policy=args.kv_policy,
        host=args.host,
        port=args.port,
        num_pages=args.num_pages,
        kv_memory=args.kv_memory,
        page_size=args.page_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_queue=args.max_queue,
        dtype=args.dtype,
        device=args.device,
        log_level=args.log_level,
        max_request_bytes=args.max_request_size,
        shutdown_grace=args.shutdown_grace,
    )
    from vllm_kvpress_ext.server.launch import serve

    serve(config)
    return 0


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.serve_bench import ServeBenchConfig, run_serve_bench

    run_serve_bench(
        ServeBenchConfig(
            url=args.url,
            model=args.model,
            policies=args.policies,
            kv_memory=args.kv_memory,
            num_requests=args.num_requests,
            concurrency=args.concurrency,
            duration=args.duration,
            prompt_len=args.prompt_len,
            max_tokens=args.max_tokens,
            max_num_seqs=args.max_num_seqs,
            page_size=args.page_size,
            device=args.device,
            dtype=args.dtype,
            seed=args.seed,
            out=args.out,
        )
    )
    return 0


def _cmd_bench_vllm_serve(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.vllm_serve_bench import VllmServeBenchConfig, run_vllm_serve_bench

    run_vllm_serve_bench(
        VllmServeBenchConfig(
            servers=tuple(s for s in args.servers.split(",") if s),
            policies=tuple(p for p in args.policies.split(",") if p),
            model=args.model,
            num_pages=args.num_pages,
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            max_concurrency=args.max_concurrency,
            max_num_seqs=args.max_num_seqs,
            seed=args.seed,
            out=args.out,
        )
    )
    return 0


def _add_bench_vllm_serve_parser(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bv = bench_sub.add_parser(
        "vllm-serve",
        help="vLLM's `vllm bench serve` (random dataset) against `vllm serve` with the plugin and `kvpress serve`",
        description="Per server and policy: starts the server on 127.0.0.1 with --num-pages KV pages, runs "
        "`vllm bench serve --dataset-name random` (chat, --ignore-eos) against it, and prints requests/s, TTFT, "
        "ITL and the peak number of requests the pool let run at once (kvpress_requests_running_peak). Needs the "
        "[vllm] extra.",
    )
    bv.add_argument("--servers", default="vllm,kvpress", help="default: vllm,kvpress")
    bv.add_argument("--policies", default="full,snapkv,gvote", help="default: full,snapkv,gvote")
    bv.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    bv.add_argument("--num-pages", type=int, default=1320, help="KV pool of every server, in pages (default: 1320)")
    bv.add_argument("--num-prompts", type=int, default=24, help="requests per run (default: 24)")
    bv.add_argument("--input-len", type=int, default=512, help="random prompt tokens (default: 512)")
    bv.add_argument("--output-len", type=int, default=16, help="tokens generated per request (default: 16)")
    bv.add_argument("--max-concurrency", type=int, default=24, help="requests in flight at once (default: 24)")
    bv.add_argument("--max-num-seqs", type=int, default=32, help="servers' --max-num-seqs (default: 32)")
    bv.add_argument("--seed", type=int, default=0, help="dataset seed (default: 0)")
    bv.add_argument("--out", default=None, help="also write the results as JSON to this file")
    bv.set_defaults(handler=_cmd_bench_vllm_serve)


def _add_serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server with per-request KV compression",
        description="Serve MODEL (an HF directory, a .gguf file or a catalog name) over an OpenAI-compatible API "
        "(/v1/models, /v1/completions, "
        "/v1/chat/completions with SSE streaming, /health, /metrics, /debug/kv). A request picks its KV policy "
        'with the body field kv_policy ("snapkv" or {"name": "snapkv", "ratio": 0.1}) or vllm_xargs; usage '
        "reports the KV figures the page pool held. See docs/server.md.",
    )
    serve.add_argument(
        "--random-model",
        action="store_true",
        help="serve a random-weight GQA Llama with the synthetic suite's tokenizer, written to a temporary "
        "directory: its text is noise, but the API, compression and KV figures are real (for trying the server "
        "without a trained model)",
    )
    serve.add_argument(
        "model_dir",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="HF-format model directory (config.json, safetensors, tokenizer), a .gguf file, or a catalog name "
        "such as smollm2-135m (pulled on first use, see kvpress models list); default: the bundled model "
        "vllm_kvpress_ext/assets/default_model (docs/model.md)",
    )
    serve.add_argument(
        "--kv-policy",
        default=None,
        metavar="NAME|PATH",
        help="default policy for requests that do not choose one: a name (kvpress policies) or a YAML preset "
        "path (default: none, i.e. full)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000, help="port to bind (default: 8000)")
    pool = serve.add_mutually_exclusive_group()
    pool.add_argument("--num-pages", type=_at_least(1), default=None, help="KV pool size in pages")
    pool.add_argument(
        "--kv-memory",
        type=_size,
        default=None,
        metavar="SIZE",
        help="KV pool size in bytes, e.g. 2GiB or 512MiB (default: 1GiB)",
    )
    serve.add_argument("--page-size", type=_at_least(1), default=16, help="tokens per KV page (default: 16)")
    serve.add_argument(
        "--max-num-seqs", type=_at_least(1), default=64, help="most requests holding KV pages at once (default: 64)"
    )
    serve.add_argument(
        "--max-num-batched-tokens",
        type=_at_least(1),
        default=2048,
        help="prompt tokens per prefill step (default: 2048)",
    )
    serve.add_argument(
        "--max-model-len", type=_at_least(2), default=None, help="prompt + output limit (default: the model's maximum)"
    )
    serve.add_argument(
        "--max-request-size",
        type=_size,
        default="2MiB",
        metavar="SIZE",
        help="largest request body accepted; larger ones get 413 unread (default: 2MiB)",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long in-flight requests may finish before they get the shutdown error "
        "(default: 30)",
    )
    serve.add_argument(
        "--policy-file",
        action="append",
        default=None,
        metavar="POLICY.FIELD:NAME=PATH",
        help="allow requests to use a policy file by NAME, e.g. xkv.profile:long=/srv/long.yaml or "
        "wgkv.gates:mine=/srv/gates.safetensors; repeatable. Requests never name paths (docs/server.md)",
    )
    serve.add_argument(
        "--max-queue",
        type=_at_least(1),
        default=1024,
        help="requests waiting for admission before new ones get 429 (default: 1024)",
    )
    serve.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="model dtype (default: auto)",
    )
    serve.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")
    serve.add_argument(
        "--served-model-name", default=None, help="model id clients send (default: the model directory's name)"
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="log level (default: info)",
    )
    serve.set_defaults(handler=_cmd_serve)


def _add_bench_serve_parser(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bs = bench_sub.add_parser(
        "serve",
        help="HTTP load test of kvpress serve: requests/s, TTFT, inter-token latency, requests held, per policy",
        description="Streams completions against a server it starts on 127.0.0.1 (one per policy, all with the same "
        "--kv-memory) or against --url. Per policy: requests/s, TTFT and inter-token latency p50/p90/p99 (client "
        "side), and the peak number of requests holding KV pages at once (from the server's metrics). The run is "
        "bounded by --num-requests and --duration. Without --model, a random-weight bench model with the suite "
        "tokenizer is written to a temporary directory.",
    )
    bs.add_argument("--url", default=None, help="base URL of a running server (default: start one per policy)")
    bs.add_argument("--model", default=None, help="HF-format model directory (default: random bench model)")
    bs.add_argument(
        "--policies",
        type=_policy_names,
        default=("full", "snapkv", "streaming_llm"),
        help="default: full,snapkv,streaming_llm",
    )
    bs.add_argument("--kv-memory", default="16MiB", help="KV pool of the servers this bench starts (default: 16MiB)")
    bs.add_argument("--num-requests", type=int, default=64, help="requests per policy (default: 64)")
    bs.add_argument("--concurrency", type=int, default=32, help="requests in flight at once (default: 32)")
    bs.add_argument("--duration", type=float, default=60.0, help="seconds per policy at most (default: 60)")
    bs.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request (default: 512)")
    bs.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default: 32)")
    bs.add_argument("--max-num-seqs", type=int, default=64, help="server's --max-num-seqs (default: 64)")
    bs.add_argument("--page-size", type=int, default=16, help="server's --page-size (default: 16)")
    bs.add_argument("--device", default="cpu", help="server's torch device (default: cpu)")
    bs.add_argument("--dtype", default="float32", help="server's model dtype (default: float32)")
    bs.add_argument("--seed", type=int, default=0, help="prompt and model seed (default: 0)")
    bs.add_argument("--out", default=None, help="also write the results as JSON to this file")
    bs.set_defaults(handler=_cmd_bench_serve)


def _add_profile_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    profile = sub.add_parser(
        "profile",
        help="offline profiles for policies that can use one (xkv)",
        description="Measure a policy's per-model settings offline on sampled prompts and save them as YAML.",
    )
    profile_sub = profile.add_subparsers(dest="profile_command", metavar="POLICY")
    profile.set_defaults(handler=lambda _args: _usage_error(profile))

    xkv = profile_sub.add_parser(
        "xkv",
        help="XKV's sampling-based profile: mean per-layer cache fractions, saved as YAML",
        description="Runs --samples prompts per task of the synthetic suite (training seeds, never the held-out "
        "evaluation seeds) through the model once each with XKV's R_avg mode (target --budget), averages each "
        "layer's kept fraction m_l / P (entries kept beyond the window / entries ranked) and saves them, with how "
        "they were measured, to --out. Each fraction lies in [0, 1]; their mean is the share of the ranked prompt "
        "the profile keeps when applied with no budget. Apply it with the xkv policy's `profile` field, e.g. "
        'kv_policy {"name": "xkv", "profile": "PROFILE.yaml"}; with a ratio/tokens budget only the '
        "proportions between layers are used. Without --model, the random-weight suite bench model is profiled.",
    )
    xkv.add_argument(
        "--model",
        default=None,
        help="HF-format model directory with the suite's tokenizer (default: the random-weight suite bench model)",
    )
    xkv.add_argument("--out", required=True, metavar="PROFILE.yaml", help="where to write the profile")
    xkv.add_argument("--samples", type=int, default=8, help="prompts per task (default: 8)")
    xkv.add_argument(
        "--tasks",
        default=None,
        help="comma-separated task families (default: those `kvpress bench accuracy` runs: the needle, tracking and "
        "aggregation tasks)",
    )
    xkv.add_argument("--context-len", type=int, default=1024, help="context tokens per prompt (default: 1024)")
    xkv.add_argument(
        "--budget",
        type=float,
        default=0.9,
        metavar="R",
        help="R_avg coverage target in (0, 1] each profiled request is sized for (xkv's target_ratio; default: 0.9)",
    )
    xkv.add_argument(
        "--protocol",
        choices=("served", "strict", "agnostic"),
        default="strict",
        help="compression point profiled: prompts are cut where this protocol compresses (default: strict, as "
        "kvpress bench accuracy)",
    )
    xkv.add_argument("--seed", type=int, default=0, help="first training seed; seeds SEED..SEED+samples-1 (default: 0)")
    xkv.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    xkv.add_argument("--dtype", default="float32", help="model dtype (default: float32)")
    xkv.set_defaults(handler=_cmd_profile_xkv)


def _cmd_bench_kernels(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.kernels_bench import (
        KernelsBenchConfig,
        KernelsBenchUnavailableError,
        run_kernels_bench,
    )

    config = KernelsBenchConfig(
        requests=args.requests,
        kept_tokens=args.kept_tokens,
        full_context=args.full_context,
        retentions=args.retentions,
        prefill_lens=args.prefill_lens,
        admission=args.admission,
        window=args.window,
        dtype=args.dtype,
        repeats=args.repeats,
        cuda_ext=args.cuda_ext,
    )
    try:
        run_kernels_bench(config)
    except KernelsBenchUnavailableError as exc:
        print(f"kvpress bench kernels: {exc}", file=sys.stderr)
        return 2
    return 0


def _add_bench_kernels_parser(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bk = bench_sub.add_parser(
        "kernels",
        help="GPU only: decode bandwidth vs device copy, decode and vertical-slash prefill speedups over dense SDPA",
        description="Needs a CUDA device and triton (exits with status 2 otherwise). Measures the device copy "
        "bandwidth, the Triton decode kernel's effective bandwidth (kept K/V bytes / time) as a share of it, decode "
        "speedup over dense SDPA on the unpruned cache at several retentions, and vertical-slash prefill speedup "
        "over dense causal SDPA. CUDA-event timing, warm-up, medians.",
    )
    bk.add_argument("--requests", type=int, default=32, help="decode batch (default: 32)")
    bk.add_argument("--kept-tokens", type=int, default=8192, help="mean kept tokens per head (default: 8192)")
    bk.add_argument("--full-context", type=int, default=16384, help="unpruned tokens per head (default: 16384)")
    bk.add_argument("--retentions", type=_float_list, default=(0.1, 0.25, 0.5), help="default: 0.1,0.25,0.5")
    bk.add_argument(
        "--prefill-lens", type=_int_list, default=(32768, 65536, 131072), help="default: 32768,65536,131072"
    )
    bk.add_argument("--admission", type=float, default=0.25, help="admitted fraction in prefill (default: 0.25)")
    bk.add_argument("--window", type=int, default=1024, help="vertical-slash local band (default: 1024)")
    bk.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"), help="default: float16")
    bk.add_argument("--repeats", type=int, default=10, help="timed calls per decode point, median (default: 10)")
    bk.add_argument("--cuda-ext", action="store_true", help="also build and time the CUDA decode kernel in csrc/")
    bk.set_defaults(handler=_cmd_bench_kernels)


def _cmd_bench_prefill_peak(args: argparse.Namespace) -> int:
    from vllm_kvpress_ext.bench.prefill_peak import PrefillPeakConfig, run_prefill_peak_bench

    try:
        run_prefill_peak_bench(
            PrefillPeakConfig(
                model=args.model,
                context_len=args.context_len,
                ratio=args.ratio,
                max_batched_tokens=args.max_batched_tokens,
                profile=args.profile,
                dtype=args.dtype,
                device=args.device,
                seed=args.seed,
            )
        )
    except ValueError as exc:
        print(f"kvpress bench prefill-peak: {exc}", file=sys.stderr)
        return 2
    return 0


def _add_bench_prefill_peak_parser(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    pp = bench_sub.add_parser(
        "prefill-peak",
        help="KV memory at the prefill peak vs after compression: end-of-prefill vs layer-wise compression",
        description="One prompt per row (full, xkv, xkv with a profile compressed layer by layer, lava one-shot, "
        "lava cascading), all at one ratio budget: the request's exact high-water mark of KV pages during prefill, "
        "what it holds after compression, and what admission reserves. Without --model, the random-weight bench "
        "model is used; without --profile, an XKV profile is measured first on two other prompts.",
    )
    pp.add_argument("--model", default=None, help="HF-format model directory (default: random bench model)")
    pp.add_argument("--context-len", type=int, default=2048, help="prompt tokens (default: 2048)")
    pp.add_argument("--ratio", type=float, default=0.25, help="mean fraction kept by xkv and lava (default: 0.25)")
    pp.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="prefill chunk size (default: the whole prompt in one chunk; layer-wise compression only lowers "
        "the peak of the last chunk)",
    )
    pp.add_argument("--profile", default=None, help="XKV profile YAML (default: measure one first)")
    pp.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    pp.add_argument("--dtype", default="float32", help="model dtype (default: float32)")
    pp.add_argument("--seed", type=int, default=0, help="default: 0")
    pp.set_defaults(handler=_cmd_bench_prefill_peak)


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (`kvpress serve: error: ...`) and exit status 2, never a traceback."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = _Parser(
        prog="kvpress",
        description="KV-cache compression for LLM serving: per-head policies over a paged pool that frees "
        "what it drops.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    info = sub.add_parser("info", help="print versions, devices and optional backends (triton, CUDA)")
    info.set_defaults(handler=_cmd_info)

    demo = sub.add_parser(
        "demo",
        help="show a paged per-head cache freeing memory when a keep plan is applied",
        description="Fill the paged per-head KV pool with synthetic requests, apply a per-head keep plan, "
        "and print the pool's used pages before and after: the memory really comes back.",
    )
    demo.add_argument("--requests", type=int, default=4, help="number of synthetic requests (default: 4)")
    demo.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request (default: 512)")
    demo.add_argument("--keep-ratio", type=float, default=0.25, help="mean fraction of tokens kept (default: 0.25)")
    demo.set_defaults(handler=_cmd_demo)

    policies = sub.add_parser(
        "policies",
        help="list every registered compression policy with its defaults",
        description="Every policy is usable by name (e.g. --kv-policy snapkv), by a YAML preset path, or as "
        "{'name': ..., params} per request.",
    )
    policies.set_defaults(handler=_cmd_policies)

    _add_serve_parser(sub)
    add_models_parser(sub)

    tm = sub.add_parser(
        "train-model",
        help="train a small GQA Llama on the synthetic suite (checkpoints, resume, held-out eval)",
        description="Trains a Llama-architecture model with grouped-query attention from scratch on a mixture of "
        "the synthetic suite's tasks, with a context-length curriculum, periodic held-out exact-match evaluation, "
        "checkpoints (--resume continues from OUT/checkpoint.pt) and a log (OUT/log.jsonl). The model is exported "
        "as an HF directory in OUT/model.",
    )
    tm.add_argument("--out", default="runs/model", help="output directory (default: runs/model)")
    tm.add_argument("--steps", type=int, default=20_000, help="optimizer steps (default: 20000)")
    tm.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop after this step, keeping the learning-rate and context schedule of --steps",
    )
    tm.add_argument("--batch-size", type=int, default=16, help="sequences per step (default: 16)")
    tm.add_argument("--context-len", type=int, default=1024, help="final context length (default: 1024)")
    tm.add_argument(
        "--curriculum",
        type=_int_list,
        default=(128, 256, 512),
        help="context lengths before the final one, equal shares of the steps outside --final-share "
        "(default: 128,256,512)",
    )
    tm.add_argument("--hidden-size", type=int, default=128, help="default: 128")
    tm.add_argument("--intermediate-size", type=int, default=384, help="default: 384")
    tm.add_argument("--layers", type=int, default=4, help="default: 4")
    tm.add_argument("--heads", type=int, default=4, help="query heads (default: 4)")
    tm.add_argument("--kv-heads", type=int, default=2, help="KV heads (default: 2)")
    tm.add_argument("--rope-theta", type=float, default=500_000.0, help="RoPE base (default: 500000)")
    tm.add_argument("--init-std", type=float, default=0.02, help="std of the normal weight init (default: 0.02)")
    tm.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: 1e-3)")
    tm.add_argument("--warmup", type=int, default=200, help="warm-up steps (default: 200)")
    tm.add_argument(
        "--final-share",
        type=float,
        default=0.4,
        help="fraction of steps at --context-len; the curriculum shares the rest (default: 0.4)",
    )
    tm.add_argument("--eval-every", type=int, default=500, help="default: 500")
    tm.add_argument("--eval-samples", type=int, default=32, help="held-out samples per task (default: 32)")
    tm.add_argument("--checkpoint-every", type=int, default=500, help="default: 500")
    tm.add_argument("--seed", type=int, default=0, help="default: 0")
    tm.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    tm.add_argument(
        "--tasks",
        type=_task_weights,
        default=None,
        help="task mixture as name:weight,... (default: associative_recall:2,niah_multikey:2, the other families 1)",
    )
    tm.add_argument(
        "--task-param",
        action="append",
        default=None,
        metavar="TASK.PARAM=VALUE",
        help="a task generator parameter, repeatable, e.g. associative_recall.num_records=8 (see kvpress.bench.tasks)",
    )
    tm.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    tm.add_argument(
        "--init-from",
        default=None,
        metavar="CHECKPOINT",
        help="start from the weights and optimizer moments of another run's checkpoint.pt (step and learning-rate "
        "schedule start afresh), e.g. to go "
        "on to longer contexts or another task mixture",
    )
    tm.set_defaults(handler=_cmd_train_model)

    tg = sub.add_parser(
        "train-gate",
        help="train WG-KV write gates for a frozen model (self-distillation)",
        description="Trains one write gate per (layer, KV head) of MODEL_DIR, the model frozen: the loss is the L2 "
        "distance of the final hidden states under write-gated attention to those under full attention, plus "
        "lambda * mean(g + g(1 - g)). Gates are saved as safetensors beside the model directory (default "
        "MODEL_DIR.wgkv.safetensors, which policy wgkv loads by default); the admitted fraction per layer and head "
        "on held-out samples is printed and drawn as a heatmap.",
    )
    tg.add_argument("model_dir", metavar="MODEL_DIR", help="HF-format model directory")
    tg.add_argument("--out", default=None, help="gate file (default: MODEL_DIR.wgkv.safetensors beside the model)")
    tg.add_argument(
        "--lambda", dest="lam", type=float, default=0.05, help="sparsity weight: higher admits less (default: 0.05)"
    )
    tg.add_argument("--local-window", type=int, default=64, help="W_local, tokens always kept (default: 64)")
    tg.add_argument("--tau", type=float, default=0.1, help="admission threshold for reporting (default: 0.1)")
    tg.add_argument("--steps", type=int, default=300, help="optimizer steps (default: 300)")
    tg.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: 8)")
    tg.add_argument("--context-len", type=int, default=512, help="suite sample length in tokens (default: 512)")
    tg.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (default: 1e-3)")
    tg.add_argument(
        "--init-bias", type=float, default=1.0, help="gates' initial output bias: sigmoid(1) = 0.73 open (default: 1)"
    )
    tg.add_argument("--eval-samples", type=int, default=16, help="held-out samples for the admitted fraction")
    tg.add_argument("--seed", type=int, default=0, help="default: 0")
    tg.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    tg.add_argument("--tasks", type=_task_weights, default=None, help="task mixture as name:weight,... (default: all)")
    tg.set_defaults(handler=_cmd_train_gate)

    bench = sub.add_parser("bench", help="benchmarks that print tables")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    bench.set_defaults(handler=lambda _args: _usage_error(bench))

    cache = bench_sub.add_parser(
        "cache",
        help="decode-step bookkeeping cost and compaction throughput of the paged per-head cache",
        description="Times the cache's decode-step bookkeeping (page allocation, slot mapping, block-table update "
        "for every request x layer x KV head) against a naive per-head Python loop, and the compaction "
        "throughput of applying keep plans.",
    )
    cache.add_argument("--requests", type=int, default=64, help="running requests (default: 64)")
    cache.add_argument("--layers", type=int, default=32, help="layers (default: 32)")
    cache.add_argument("--kv-heads", type=int, default=8, help="KV heads per layer (default: 8)")
    cache.add_argument("--head-dim", type=int, default=128, help="head dimension (default: 128)")
    cache.add_argument("--page-size", type=int, default=16, help="tokens per page (default: 16)")
    cache.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per request (default: 256)")
    cache.add_argument("--steps", type=int, default=64, help="decode steps timed (default: 64)")
    cache.add_argument("--keep-ratio", type=float, default=0.25, help="fraction kept by compaction (default: 0.25)")
    cache.set_defaults(handler=_cmd_bench_cache)

    throughput = bench_sub.add_parser(
        "throughput",
        help="prefill and decode tokens/s of the embedded engine",
        description="Prefill and decode tokens/s of the embedded engine at several batch sizes and prompt "
        "lengths. Without --model, a random-weight GQA Llama (4 layers, hidden 256, 8 heads, 2 KV heads) is "
        "written to a temporary directory and used.",
    )
    throughput.add_argument("--model", default=None, help="HF-format model directory (default: random bench model)")
    throughput.add_argument("--batch-sizes", type=_int_list, default=(1, 4, 16), help="default: 1,4,16")
    throughput.add_argument("--prompt-lens", type=_int_list, default=(128, 512), help="default: 128,512")
    throughput.add_argument("--decode-steps", type=int, default=32, help="decode steps timed (default: 32)")
    throughput.add_argument("--repeats", type=int, default=2, help="runs per point, median reported (default: 2)")
    throughput.add_argument("--kv-policy", default=None, help="policy name or preset path (default: none)")
    throughput.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    throughput.add_argument("--dtype", default="float32", help="model dtype (default: float32)")
    throughput.set_defaults(handler=_cmd_bench_throughput)

    cap = bench_sub.add_parser(
        "capacity",
        help="requests held at once and output tokens/s in one fixed KV pool, per policy",
        description="Queue --requests prompts of --prompt-len random tokens at once on one engine with a fixed "
        "KV pool; per policy (at --ratio of the prompt where it has a budget): the most requests holding pages "
        "at once, output and decode tokens/s, retention, KV bytes per request and preemptions. Without --model, "
        "a random-weight model of --shape is written to a temporary directory.",
    )
    cap.add_argument("--model", default=None, help="HF-format model directory (default: random model of --shape)")
    cap.add_argument(
        "--shape", default="bench", choices=("bench", "llama3-8b"), help="random model shape (default: bench)"
    )
    cap.add_argument("--policies", default="full,snapkv,gvote,wgkv", help="default: full,snapkv,gvote,wgkv")
    cap.add_argument("--ratio", type=float, default=0.25, help="fraction of the prompt kept (default: 0.25)")
    cap.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens per request (default: 2048)")
    cap.add_argument("--new-tokens", type=int, default=32, help="generated tokens per request (default: 32)")
    cap.add_argument("--requests", type=int, default=16, help="requests queued at once (default: 16)")
    cap.add_argument("--kv-memory", type=_size, default=64 * 2**20, metavar="SIZE", help="KV pool (default: 64MiB)")
    cap.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="prompt tokens per prefill step (default: 8192)"
    )
    cap.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    cap.add_argument("--dtype", default="float32", help="model dtype (default: float32)")
    cap.set_defaults(handler=_cmd_bench_capacity)

    pol = bench_sub.add_parser(
        "policies",
        help="compression time as a share of prefill, and retention, per policy",
        description="For each policy and prompt length: prefill time, compression time and its share of "
        "prefill, decode-hook time per step, retention and KV bytes held (from the pool). Without --model, the "
        "random-weight bench model is used.",
    )
    pol.add_argument("--model", default=None, help="HF-format model directory (default: random bench model)")
    pol.add_argument("--policies", default=None, help="comma-separated policy names (default: all registered)")
    pol.add_argument("--prompt-lens", type=_int_list, default=(2048, 8192), help="default: 2048,8192")
    pol.add_argument("--decode-steps", type=int, default=8, help="decode steps after prefill (default: 8)")
    pol.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    pol.add_argument("--dtype", default="float32", help="model dtype (default: float32)")
    pol.set_defaults(handler=_cmd_bench_policies)

    acc = bench_sub.add_parser(
        "accuracy",
        help="accuracy and prompt coverage vs KV memory actually held, per policy x budget x task",
        description="Runs the synthetic long-context suite through the engine with real compression and reports, "
        "per policy x budget x task, exact-match accuracy, the KV bytes the pool held (mean, p90), retention, and "
        "coverage: the share of prompt positions still held by at least one (layer, KV head) when a request "
        "finishes (and per layer by at least one of its heads, averaged over layers: head cov). Output: a table on "
        "stdout, results.md/.csv/.json and accuracy_vs_memory.png in --out. A real pretrained model (any other "
        "tokenizer, e.g. --model smollm2-135m) gets the natural-language tasks instead (RULER-style needles, "
        "variable tracking, word counting, pass key; every registered policy at 50/25/10% by default, 2K and 4K "
        "tokens, each sample's shared prefix prefilled once; see vllm_kvpress_ext/bench/natural_accuracy.py).",
    )
    acc.add_argument(
        "--model",
        default=None,
        help="model directory, .gguf file or catalog name (default: the bundled model)",
    )
    acc.add_argument(
        "--suite",
        choices=("auto", "synthetic", "natural"),
        default="auto",
        help="task suite: synthetic (the suite's word-level tasks), natural (English tasks for any tokenizer); "
        "auto: synthetic for models with the suite's tokenizer, natural otherwise",
    )
    acc.add_argument(
        "--context-lens", type=_int_list, default=None, help="natural suite: prompt lengths (default: 2048,4096)"
    )
    acc.add_argument(
        "--filler", choices=("noise", "prose"), default=None, help="natural suite: haystack text (default: noise)"
    )
    acc.add_argument("--policies", default=None, help="comma-separated policies (default: full and the baselines)")
    acc.add_argument("--budgets", type=_float_list, default=None, help="ratios (default: 0.5,0.25,0.1,0.05)")
    acc.add_argument(
        "--tasks",
        default=None,
        help="comma-separated task families (default: the needle, tracking and aggregation tasks)",
    )
    acc.add_argument(
        "--protocol",
        choices=("served", "strict", "agnostic"),
        default=None,
        help="where compression happens (default: strict; natural suite: agnostic, or served)",
    )
    acc.add_argument("--samples", type=int, default=None, help="held-out samples per task (default: 20)")
    acc.add_argument(
        "--task-param",
        action="append",
        default=None,
        metavar="TASK.PARAM=VALUE",
        help="a task generator parameter, repeatable, e.g. associative_recall.num_records=8",
    )
    acc.add_argument("--context-len", type=int, default=None, help="context tokens per sample (default: 1024)")
    acc.add_argument("--out", default=None, help="output directory (default: runs/accuracy)")
    acc.add_argument(
        "--quick", action="store_true", help="small run: 3 policies, budget 0.25, 2 tasks, 4 samples, context 256"
    )
    acc.set_defaults(handler=_cmd_bench_accuracy)

    _add_bench_serve_parser(bench_sub)
    _add_bench_vllm_serve_parser(bench_sub)
    _add_bench_kernels_parser(bench_sub)
    _add_bench_prefill_peak_parser(bench_sub)
    _add_bench_kvpress_parity_parser(bench_sub)
    _add_profile_parser(sub)
    return parser


def _add_bench_kvpress_parity_parser(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from vllm_kvpress_ext.bench import kvpress_parity

    parity = bench_sub.add_parser(
        "kvpress-parity",
        help="kept-set overlap and accuracy against NVIDIA kvpress 0.5.5 (run from its own venv), same prompts",
        description="Runs NVIDIA kvpress 0.5.5 (in its own venv: `make kvpress-venv`) and this project on the same "
        "prompts and fp32 weights of a real model (default smollm2-135m), with SnapKV, StreamingLLM, PyramidKV and "
        "AdaKV at matched settings, and prints per policy and kept ratio the overlap of the kept (layer, KV head, "
        "position) sets and both systems' accuracy (question-agnostic protocol). See docs/parity.md.",
    )
    kvpress_parity.add_arguments(parity)
    parity.set_defaults(handler=kvpress_parity.run)


def _usage_error(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    try:
        return handler(args)
    except (ValueError, OSError) as exc:  # a bad value only found past parsing (a file, a combination)
        command = " ".join(str(getattr(args, k)) for k in ("command", "bench_command") if getattr(args, k, None))
        print(f"kvpress {command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
