"""`kvpress bench policies` for two source trees, alternating, timed in process CPU time as well.

Wall-clock shares of prefill are what the bench reports, but on a machine shared with other work
they swing by several times from one run to the next: a waiting process's wall time is not its own.
This runs the bench of tree A, then tree B, then A, then B, ... (each in its own process, so each
imports its own package), once with the bench's wall clocks and once with both of its clocks (the
engine's compression clock and the bench's prefill clock) switched to the process's CPU time, which
counts the work done by all of torch's threads and nothing else. CPU-time shares are what to compare
across trees; both tables are printed.

Usage: python tools/policy_cost_ab.py BEFORE_DIR AFTER_DIR [--rounds 2] [--clocks wall,cpu] [-- BENCH ARGS...]
where each DIR is a source tree holding `vllm_kvpress_ext/` (e.g. `git archive <commit> | tar -x -C DIR`).
Example: python tools/policy_cost_ab.py /tmp/before . -- --prompt-lens 8192
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

# Run inside each child: optionally switch the clocks, then the bench's own CLI entry point.
CHILD = """
import sys, time
if sys.argv[1] == "cpu":
    from vllm_kvpress_ext.engine.model_runner import ModelRunner
    ModelRunner.clock = lambda self: time.process_time()  # compression time
    time.perf_counter = time.process_time  # the bench's prefill clock
from vllm_kvpress_ext.cli import main
raise SystemExit(main(["bench", "policies", *sys.argv[2:]]))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clocks", default="wall,cpu", help="comma-separated: wall, cpu (default: both)")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    bench_args = argv[split + 1 :]
    for round_index in range(1, args.rounds + 1):
        for clock in args.clocks.split(","):
            for label, tree in (("before", args.before), ("after", args.after)):
                tree = os.path.abspath(tree)
                print(f"=== {label} ({tree}), {clock} clock, round {round_index}", flush=True)
                env = {**os.environ, "PYTHONPATH": tree}
                subprocess.run([sys.executable, "-c", CHILD, clock, *bench_args], cwd=tree, env=env, check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
