"""Merge several `kvpress bench accuracy` output directories (natural tasks) into one report.

A long accuracy table runs best as one `bench accuracy` per (task, length), so that every finished
run is on disk whatever becomes of the later ones; this writes the combined tables (mean over tasks
and per task), results.md/.csv/.json and accuracy_vs_memory.png into OUT.

Usage: python tools/merge_accuracy.py OUT RESULT_DIR [RESULT_DIR ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, run from anywhere

from vllm_kvpress_ext.bench.natural_accuracy import merge_results


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        merge_results([Path(d) for d in argv[1:]], Path(argv[0]))
    except ValueError as exc:
        print(f"merge_accuracy: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
