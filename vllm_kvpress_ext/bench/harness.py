"""What the benches share: a free port, a server subprocess that is healthy before use and always stopped
after, the value of one series scraped from `/metrics`, and one request timed alone on an engine.

`kvpress bench serve` and `kvpress bench vllm-serve` (and the comparison that runs both servers) start
their servers through `served`, so a server that dies while starting, never answers `/health`, or
outlives its bench is handled in one place. Tables come from `bench.report`, policies at a budget from
`bench.budgets`.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from vllm_kvpress_ext.engine import LLMEngine, RequestOutput, SamplingParams

HOST = "127.0.0.1"
_LOG_TAIL = 3000  # characters of a failed server's log quoted in the error


def free_port() -> int:
    """A TCP port on `HOST` that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def wait_healthy(
    url: str, process: subprocess.Popen[bytes], log: Path, timeout: float, name: str, poll_s: float = 0.1
) -> None:
    """Return once `GET url/health` answers 200; raise with the log's tail if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited ({process.returncode}):\n{log.read_text()[-_LOG_TAIL:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} not healthy after {timeout:g}s:\n{log.read_text()[-_LOG_TAIL:]}")
        time.sleep(poll_s)


def stop(process: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """SIGINT to the server's process group (vLLM's engine core is a child), SIGKILL if it outlasts `timeout`."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


@contextlib.contextmanager
def served(
    command: Sequence[str],
    port: int,
    log: Path,
    *,
    name: str,
    startup_timeout: float,
    env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """Run `command` (a server listening on `port`) with its output in `log`; yield its base URL once healthy,
    and stop it on the way out, whatever happened."""
    with open(log, "wb") as handle:
        process = subprocess.Popen(
            list(command),
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=dict(os.environ if env is None else env),
            start_new_session=True,  # its own process group: `stop` reaches every child
        )
    try:
        url = f"http://{HOST}:{port}"
        wait_healthy(url, process, log, startup_timeout, name)
        yield url
    finally:
        stop(process)


def scrape_metric(text: str, name: str) -> float | None:
    """The value of series `name` (labels or none) in a Prometheus text exposition; None when absent."""
    match = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+|NaN)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def run_alone(
    engine: LLMEngine, prompt: list[int], params: SamplingParams, policy: Any
) -> tuple[RequestOutput, float, float]:
    """Run one request on an idle engine to its end: its output, and the wall and process CPU seconds it took.

    A request that failed raises, so no bench reports the figures of an error."""
    engine.add_request(prompt, params, policy=policy)
    outputs: list[RequestOutput] = []
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    if outputs[0].finish_reason == "error":
        raise ValueError(f"policy {policy}: the request failed: {outputs[0].error}")
    return outputs[0], seconds, cpu_seconds
