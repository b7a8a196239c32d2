"""`kvpress bench BENCH`: one module per bench, each with `register(bench_sub)` and its handler `run(args)`.

A new bench is a module here and one entry in `BENCHES` (the order is the order of `kvpress bench --help`).
"""

from __future__ import annotations

from vllm_kvpress_ext.cli.bench import (
    accuracy,
    cache,
    capacity,
    decode_step,
    gated_prefill,
    kernels,
    kvpress_parity,
    linear,
    policies,
    prefill,
    prefill_peak,
    recall,
    serve,
    tensor_parallel,
    throughput,
    vllm_serve,
)
from vllm_kvpress_ext.cli.common import Subparsers, show_usage_when_bare

BENCHES = (
    cache,
    throughput,
    capacity,
    decode_step,
    policies,
    accuracy,
    serve,
    vllm_serve,
    tensor_parallel,
    kernels,
    prefill,
    linear,
    prefill_peak,
    gated_prefill,
    kvpress_parity,
    recall,
)


def register(sub: Subparsers) -> None:
    bench = sub.add_parser("bench", help="benchmarks that print tables")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    show_usage_when_bare(bench)
    for module in BENCHES:
        module.register(bench_sub)
