"""`kvpress serve`: the OpenAI-compatible HTTP server over the embedded engine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_kvpress_ext.api import DEFAULT_CONTEXT_POLICY, OPERATOR_POLICY_HELP, PREFIX_MATCHING_MODES
from vllm_kvpress_ext.cli.common import Subparsers, at_least, port, seconds, size
from vllm_kvpress_ext.cli.models import resolve_model_arg


def register(sub: Subparsers) -> None:
    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server with per-request KV compression",
        description="Serve MODEL (an HF directory, a .gguf file or a catalog name) over an OpenAI-compatible API "
        "(/v1/models, /v1/completions, "
        "/v1/chat/completions with SSE streaming, /health, /metrics, /debug/kv). A request picks its KV policy "
        'with the body field kv_policy ("snapkv" or {"name": "snapkv", "ratio": 0.1}) or vllm_xargs; usage '
        "reports the KV figures the page pool held. See docs/server.md.",
    )
    _add_model_arguments(serve)
    _add_engine_arguments(serve)
    _add_http_arguments(serve)
    serve.set_defaults(handler=run)


def _add_model_arguments(serve: argparse.ArgumentParser) -> None:
    """What is served, how it is loaded, and the policy of requests that choose none."""
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
        metavar="POLICY",
        help="default policy for requests that do not choose one: " + OPERATOR_POLICY_HELP + " (default: full)",
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


def _add_engine_arguments(serve: argparse.ArgumentParser) -> None:
    """The KV pool, the scheduler's limits and the compressed-prefix store."""
    pool = serve.add_mutually_exclusive_group()
    pool.add_argument("--num-pages", type=at_least(1), default=None, help="KV pool size in pages")
    pool.add_argument(
        "--kv-memory",
        type=size,
        default=None,
        metavar="SIZE",
        help="KV pool size in bytes, e.g. 2GiB or 512MiB (default: 1GiB)",
    )
    serve.add_argument("--page-size", type=at_least(1), default=16, help="tokens per KV page (default: 16)")
    serve.add_argument(
        "--max-num-seqs", type=at_least(1), default=64, help="most requests holding KV pages at once (default: 64)"
    )
    serve.add_argument(
        "--max-num-batched-tokens",
        type=at_least(1),
        default=2048,
        help="prompt tokens per prefill step (default: 2048)",
    )
    serve.add_argument(
        "--max-model-len", type=at_least(2), default=None, help="prompt + output limit (default: the model's maximum)"
    )
    serve.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep compressed contexts (kv_prefix_tokens, kv_prefix_messages, a chat's default context; with "
        "--prefix-matching auto, also every finished request's cache) for later requests with the same context, "
        "policy and model to reuse, and exact caches: of every finished request that nothing compressed (policy "
        "full), and of every compressing request's prompt just before it compresses, which later prompts starting "
        "with the same tokens read (a compressing one up to its policy's observation window); they are dropped, "
        "least recently used first, before any running request is preempted or a waiting one refused (default: "
        "on; docs/prefix_reuse.md)",
    )
    serve.add_argument(
        "--max-cached-prefixes",
        type=at_least(1),
        default=16,
        help="most compressed contexts (and, with --prefix-matching auto, finished conversations) kept at once "
        "(default: 16)",
    )
    serve.add_argument(
        "--context-policy",
        default=DEFAULT_CONTEXT_POLICY,
        help="in chat, the messages before the last user message are a context by default (when the request "
        "names none and its policy compresses): compressed once on its own and reused by every later question "
        "about it. A request whose policy chooses from the context alone (kvzip, expected_attention, "
        "streaming_llm) compresses it with its own; one whose policy scores by the prompt's last tokens (snapkv, "
        "adakv, ...), which would lose the answers, with this policy at the request's budget. A name, a JSON "
        "object or a preset; `request`: each request's own policy; `none`: no default context "
        "(default: kvzip; docs/prefix_reuse.md)",
    )
    serve.add_argument(
        "--prefix-matching",
        choices=PREFIX_MATCHING_MODES,
        default="named",
        help="for compressed caches (uncompressed ones are reused exactly in both modes): named: only requests "
        "that name their context (kv_prefix_tokens / kv_prefix_messages, or a chat's default context, "
        "--context-policy) store or reuse it; auto: also attach any request to the longest stored prefix of its "
        "prompt with the same policy and parameters, keep each finished request's cache for the next turn of "
        "its conversation, and use a chat's default context only where nothing stored matches; this changes "
        "what a compressing policy sees (default: named; docs/prefix_reuse.md)",
    )


def _add_http_arguments(serve: argparse.ArgumentParser) -> None:
    """Where the server listens and what it accepts."""
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=port, default=8000, help="port to bind (default: 8000)")
    serve.add_argument(
        "--max-request-size",
        type=size,
        default="2MiB",
        metavar="SIZE",
        help="largest request body accepted; larger ones get 413 unread (default: 2MiB)",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=seconds,
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
        type=at_least(1),
        default=1024,
        help="requests waiting to start before new ones get 429 (default: 1024)",
    )


def run(args: argparse.Namespace) -> int:
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
    from vllm_kvpress_ext.api.policy_spec import parse_operator_policy
    from vllm_kvpress_ext.policies import PolicyConfigError

    try:  # fail before loading the model
        kv_policy = None if args.kv_policy is None else parse_operator_policy(args.kv_policy)
    except PolicyConfigError as exc:
        print(f"kvpress serve: --kv-policy: {exc}", file=sys.stderr)
        return 2
    from vllm_kvpress_ext.api.context_policy import parse_context_policy

    try:
        context_policy = parse_context_policy(args.context_policy)
    except PolicyConfigError as exc:
        print(f"kvpress serve: {exc}", file=sys.stderr)
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
        kv_policy=kv_policy,
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
        enable_prefix_caching=args.enable_prefix_caching,
        max_cached_prefixes=args.max_cached_prefixes,
        prefix_matching=args.prefix_matching,
        context_policy=context_policy,
    )
    from vllm_kvpress_ext.server.launch import serve

    serve(config)
    return 0
