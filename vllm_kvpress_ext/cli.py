"""The `kvpress` command line.

Sub-commands import their heavy modules lazily so that `kvpress --help` stays instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from vllm_kvpress_ext import __version__

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
        print("kvpress bench accuracy: --model is required (no bundled model ships yet)", file=sys.stderr)
        return 2
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
    config = dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})
    run_accuracy_bench(config)
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
        lr=args.lr,
        warmup=args.warmup,
        eval_every=args.eval_every,
        eval_samples=args.eval_samples,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        threads=args.threads,
        **({"tasks": args.tasks} if args.tasks else {}),
    )
    try:
        model_dir = train(config, resume=args.resume)
    except ValueError as err:
        print(f"kvpress train-model: {err}", file=sys.stderr)
        return 2
    print(f"model written to {model_dir}")
    return 0


def _size(text: str) -> int:
    from vllm_kvpress_ext.server.config import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
            policies=tuple(p for p in args.policies.split(",") if p),
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


def _add_serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server with per-request KV compression",
        description="Serve MODEL_DIR over an OpenAI-compatible API (/v1/models, /v1/completions, "
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
        metavar="MODEL_DIR",
        help="HF-format model directory (config.json, safetensors, tokenizer); default: the bundled model "
        "vllm_kvpress_ext/assets/default_model, which does not ship yet, so this is required for now",
    )
    serve.add_argument(
        "--kv-policy",
        default=None,
        metavar="NAME|PATH",
        help="default policy for requests that do not choose one: a name (kvpress policies) or a YAML preset "
        "path (default: none, i.e. full)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    pool = serve.add_mutually_exclusive_group()
    pool.add_argument("--num-pages", type=int, default=None, help="KV pool size in pages")
    pool.add_argument(
        "--kv-memory",
        type=_size,
        default=None,
        metavar="SIZE",
        help="KV pool size in bytes, e.g. 2GiB or 512MiB (default: 1GiB)",
    )
    serve.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default: 16)")
    serve.add_argument(
        "--max-num-seqs", type=int, default=64, help="most requests holding KV pages at once (default: 64)"
    )
    serve.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="prompt tokens per prefill step (default: 2048)"
    )
    serve.add_argument(
        "--max-model-len", type=int, default=None, help="prompt + output limit (default: the model's maximum)"
    )
    serve.add_argument(
        "--max-queue",
        type=int,
        default=1024,
        help="requests waiting for admission before new ones get 429 (default: 1024)",
    )
    serve.add_argument("--dtype", default="auto", help="model dtype: auto, float32, bfloat16, float16 (default: auto)")
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
    bs.add_argument("--policies", default="full,snapkv,streaming_llm", help="default: full,snapkv,streaming_llm")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    tm.add_argument("--batch-size", type=int, default=16, help="sequences per step (default: 16)")
    tm.add_argument("--context-len", type=int, default=1024, help="final context length (default: 1024)")
    tm.add_argument(
        "--curriculum",
        type=_int_list,
        default=(128, 256, 512),
        help="context lengths before the final one, equal shares of the first 60%% of steps (default: 128,256,512)",
    )
    tm.add_argument("--hidden-size", type=int, default=256, help="default: 256")
    tm.add_argument("--intermediate-size", type=int, default=768, help="default: 768")
    tm.add_argument("--layers", type=int, default=4, help="default: 4")
    tm.add_argument("--heads", type=int, default=8, help="query heads (default: 8)")
    tm.add_argument("--kv-heads", type=int, default=2, help="KV heads (default: 2)")
    tm.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    tm.add_argument("--warmup", type=int, default=200, help="warm-up steps (default: 200)")
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
    tm.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    tm.set_defaults(handler=_cmd_train_model)

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
        help="accuracy vs KV memory actually held, per policy x budget x task",
        description="Runs the synthetic long-context suite through the engine with real compression and reports, "
        "per policy x budget x task, exact-match accuracy and the KV bytes the pool held (mean, p90) and "
        "retention: a table on stdout, results.md/.csv/.json and accuracy_vs_memory.png in --out.",
    )
    acc.add_argument("--model", default=None, help="HF-format model directory with the suite's tokenizer (required)")
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
        help="where compression happens (default: strict)",
    )
    acc.add_argument("--samples", type=int, default=None, help="held-out samples per task (default: 20)")
    acc.add_argument("--context-len", type=int, default=None, help="context tokens per sample (default: 1024)")
    acc.add_argument("--out", default=None, help="output directory (default: runs/accuracy)")
    acc.add_argument(
        "--quick", action="store_true", help="small run: 3 policies, budget 0.25, 2 tasks, 4 samples, context 256"
    )
    acc.set_defaults(handler=_cmd_bench_accuracy)

    _add_bench_serve_parser(bench_sub)
    return parser


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
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
