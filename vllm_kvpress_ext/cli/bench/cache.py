"""`kvpress bench cache`: decode-step bookkeeping and compaction throughput of the paged per-head cache."""

from __future__ import annotations

import argparse

from vllm_kvpress_ext.cli.common import Subparsers


def register(bench_sub: Subparsers) -> None:
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
    cache.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
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
