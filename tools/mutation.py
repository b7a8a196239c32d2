"""Mutation testing of one package at a time with mutmut (`make mutation`; slow, not part of CI).

For each package named on the command line (cache, policies, engine) this copies the working tree
into build/mutation/<package>/, writes a mutmut configuration that mutates only that package and
runs only the tests that exercise it (fast tests: `-m "not slow"`), runs `mutmut run`, and prints
one table row per package: mutants, killed, survived, timed out, not covered, and the score
(killed + timed out) / mutants. The surviving mutants' names go to build/mutation/<package>/survivors.txt;
`cd build/mutation/<package> && mutmut show <name>` prints one as a diff.

Usage: python tools/mutation.py [--jobs N] [--time-limit S] [--retest-survivors] [--only GLOB]... cache policies engine

`--only` restricts the run to the mutants whose names match one of the globs (fnmatch, as mutmut
names them: `vllm_kvpress_ext.cache.manager.xǁPagedKVCacheǁevict__mutmut_53`); with
`--retest-survivors`, to the survivors among them.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "vllm_kvpress_ext"

# The tests that exercise each package; mutmut then runs, per mutant, only those that reach its function.
TESTS: dict[str, list[str]] = {
    # The cache's own tests: engine-level tests reach every cache function too, and would make each
    # surviving cache mutant cost minutes.
    "cache": [
        "tests/test_cache_properties.py",
        "tests/test_cache_manager.py",
        "tests/test_attention_reference.py",
        "tests/test_layerwise_prefill.py::test_cache_appends_compacts_one_layer_and_tracks_the_exact_peak",
        "tests/test_kernels.py::test_copy_slots_drives_compaction_and_eviction",
        "tests/test_kernels.py::test_decode_on_the_managers_layout",
        "tests/test_wgkv.py::test_lazy_promotion_keeps_admitted_plus_last_window",
        "tests/test_policies_baselines.py::test_plan_frees_exactly_the_pages_it_drops",
    ],
    "policies": [
        "tests/test_policies_baselines.py",
        "tests/test_policies_gvote_xkv.py",
        "tests/test_policies_kvec_lava.py",
        "tests/test_policy_framework.py",
        "tests/test_wgkv.py",
        "tests/test_layerwise_prefill.py",
        "tests/test_capture.py",
    ],
    "engine": [
        "tests/test_engine.py",
        "tests/test_engine_text.py",
        "tests/test_engine_decode_attention.py",
        "tests/test_sampler.py",
        "tests/test_policy_framework.py",
        "tests/test_layerwise_prefill.py",
        # Gated attention and ring start, penalties and stop suppression, prefix capture, the offline API.
        "tests/test_wgkv.py",
        "tests/test_hardening.py",
        "tests/test_prefix_fork.py",
        "tests/test_offline_api.py",
    ],
}


SKIP = {".git", ".venv", "build", "dist", "mutants", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}


def tree_files() -> list[Path]:
    """Tracked and untracked-but-not-ignored files; every file but caches and builds where git is missing."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True, capture_output=True
        ).stdout.decode()
        return [Path(name) for name in filter(None, listed.split("\0"))]
    except (OSError, subprocess.CalledProcessError):
        return [
            path.relative_to(ROOT)
            for path in ROOT.rglob("*")
            if path.is_file() and not SKIP & set(path.relative_to(ROOT).parts)
        ]


def copy_tree(destination: Path) -> None:
    """The working tree into `destination`, over an earlier copy: mutmut's results there are kept, so a
    run cut short resumes where it stopped (mutmut re-tests the functions whose source changed)."""
    for name in tree_files():
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def write_config(workdir: Path, package: str) -> None:
    """mutmut reads setup.cfg when pyproject.toml has no [tool.mutmut] section."""
    lines = [
        "[mutmut]",
        f"source_paths = {PACKAGE}",
        f"only_mutate = {PACKAGE}/{package}/*",
        "pytest_add_cli_args =",
        "    -m",
        "    not slow and not cuda",
        "    -p",
        "    no:cacheprovider",
        "pytest_add_cli_args_test_selection =",
        *(f"    {test}" for test in TESTS[package]),
        # A mutant is "timed out" past multiplier x its tests' clean duration + constant. On a shared
        # machine, load alone stretched healthy runs past 2x + 10 s (counted as caught); a mutant
        # that loops forever is still stopped, only later.
        "timeout_multiplier = 5.0",
        "timeout_constant = 30.0",
        "use_git_change_detection = false",
        # An error's message text is checked by `match=` searches, which a mutated message ("XX...XX")
        # still passes: those mutants say nothing about behaviour. The condition that raises is mutated.
        "do_not_mutate_patterns =",
        r"    ^\s*raise \w+\(",
        # Tests read presets and docs relative to the repository root, which mutmut's copy must hold.
        "also_copy =",
        *(f"    {path}" for path in ("configs", "kernels", "csrc", "docs", "README.md", "Makefile")),
    ]
    (workdir / "setup.cfg").write_text("\n".join(lines) + "\n")


def unkilled(workdir: Path, env: dict[str, str]) -> list[str]:
    """Names of the mutants an earlier run left alive (survived, or reached by no selected test)."""
    listed = subprocess.run(
        [sys.executable, "-m", "mutmut", "results"], cwd=workdir, env=env, check=True, capture_output=True, text=True
    ).stdout
    names = []
    for line in listed.splitlines():
        name, _, status = line.strip().rpartition(": ")
        if status in ("survived", "no tests"):
            names.append(name)
    return names


def run_package(
    package: str,
    jobs: int,
    build: Path,
    time_limit: float | None,
    retest_survivors: bool = False,
    only: list[str] | None = None,
) -> dict[str, int]:
    workdir = build / package
    copy_tree(workdir)
    write_config(workdir, package)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    mutmut = [sys.executable, "-m", "mutmut"]
    # mutmut keeps earlier verdicts; named mutants are tested again (against the tests as they are now).
    names = unkilled(workdir, env) if retest_survivors and (workdir / "mutants").is_dir() else []
    if only:
        names = [n for n in names if any(fnmatch.fnmatch(n, glob) for glob in only)] if retest_survivors else only
    if retest_survivors and not names:
        print(f"{package}: no surviving mutant to test again")
    else:
        # Its own process group, so a time limit stops mutmut and every test process it forked.
        command = [*mutmut, "run", "--max-children", str(jobs), *names]
        run = subprocess.Popen(command, cwd=workdir, env=env, start_new_session=True)
        try:
            run.wait(timeout=time_limit)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGTERM)
            run.wait()
            print(f"{package}: stopped after {time_limit:.0f} s; the table counts the mutants tested so far")
    subprocess.run([*mutmut, "export-cicd-stats"], cwd=workdir, env=env, check=True)
    stats = json.loads((workdir / "mutants" / "mutmut-cicd-stats.json").read_text())
    results = subprocess.run(
        [*mutmut, "results"], cwd=workdir, env=env, check=True, capture_output=True, text=True
    ).stdout
    (workdir / "survivors.txt").write_text(results)
    return {key: int(value) for key, value in stats.items()}


def tested(stats: dict[str, int]) -> int:
    return sum(stats[k] for k in ("killed", "survived", "timeout", "no_tests", "segfault", "suspicious"))


def score(stats: dict[str, int]) -> float:
    """Share of the tested mutants the tests detected: killed, or stuck past the timeout (a hang is caught).

    Mutants no selected test reaches ("no tests") count as survivors.
    """
    detected = stats["killed"] + stats["timeout"] + stats["segfault"]
    return detected / tested(stats) if tested(stats) else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="+", choices=sorted(TESTS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants tested in parallel")
    parser.add_argument("--build", type=Path, default=ROOT / "build" / "mutation", help="scratch directory")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds per package (resumable)")
    parser.add_argument(
        "--retest-survivors", action="store_true", help="test the mutants an earlier run left alive again"
    )
    parser.add_argument(
        "--only", action="append", metavar="GLOB", help="only the mutants whose names match (fnmatch); repeatable"
    )
    args = parser.parse_args(argv)
    rows = []
    for package in args.packages:
        stats = run_package(package, args.jobs, args.build, args.time_limit, args.retest_survivors, args.only)
        rows.append((package, stats))
    header = ("package", "mutants", "tested", "killed", "timeout", "survived", "no tests", "score")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for package, stats in rows:
        cells = [package, *(str(v) for v in (stats["total"], tested(stats), stats["killed"], stats["timeout"]))]
        cells += [str(stats["survived"]), str(stats["no_tests"]), f"{score(stats):.1%}"]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
