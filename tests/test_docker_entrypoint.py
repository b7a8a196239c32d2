"""The images' entrypoint scripts, run on the host.

The CPU entrypoint is run with the environment the cpu overlay's Deployment sets and the presets its
ConfigMap carries (only the bind address and port changed to a free loopback one): the command it
builds must start `kvpress serve`, pass the health check and answer a completion. Both scripts'
command lines are also checked argument by argument (`KVPRESS_PRINT_COMMAND=1`), and every bad
variable must be refused with a clear message before anything starts.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from deploy_utils import DOCKER, K8S, REPO, container_env, one, printed_command, render, server_container

from vllm_kvpress_ext.cli import build_parser
from vllm_kvpress_ext.server.config import parse_size

CPU = DOCKER / "entrypoint-cpu.sh"
VLLM = DOCKER / "entrypoint-vllm.sh"
HEALTHCHECK = DOCKER / "healthcheck.py"
PRESETS = REPO / "configs"
BUNDLED_MODEL = REPO / "vllm_kvpress_ext" / "assets" / "default_model"


def _env(**variables: str) -> dict[str, str]:
    """A clean environment: PATH with this interpreter's bin first (where `kvpress` lives), plus `variables`."""
    base = {key: value for key, value in os.environ.items() if not key.startswith("KVPRESS_")}
    base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"
    return {**base, **variables}


def _command(script: Path, *args: str, **variables: str) -> list[str]:
    return printed_command(script, *args, env=_env(**variables))


def _refused(script: Path, *args: str, **variables: str) -> str:
    result = subprocess.run(
        [str(script), *args],
        env=_env(KVPRESS_PRINT_COMMAND="1", **variables),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    return result.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_cpu_command_from_every_variable() -> None:
    argv = _command(
        CPU,
        "--max-queue",
        "8",
        KVPRESS_MODEL_DIR=str(BUNDLED_MODEL),
        KVPRESS_KV_POLICY="gvote",
        KVPRESS_PRESETS_DIR=str(PRESETS),
        KVPRESS_HOST="127.0.0.1",
        KVPRESS_PORT="8123",
        KVPRESS_KV_MEMORY="64MiB",
        KVPRESS_MAX_NUM_SEQS="4",
        KVPRESS_MAX_MODEL_LEN="512",
        KVPRESS_SERVED_MODEL_NAME="tiny",
        KVPRESS_LOG_LEVEL="warning",
    )
    assert argv == [
        "kvpress", "serve", str(BUNDLED_MODEL),
        "--kv-policy", str(PRESETS / "gvote.yaml"),
        "--host", "127.0.0.1", "--port", "8123",
        "--kv-memory", "64MiB", "--max-num-seqs", "4", "--max-model-len", "512",
        "--served-model-name", "tiny", "--log-level", "warning",
        "--max-queue", "8",
    ]  # fmt: skip
    # `kvpress serve`'s own parser accepts the line and reads each value where it was meant to go.
    args = build_parser().parse_args(argv[1:])
    assert (args.model_dir, args.kv_policy, args.host, args.port) == (
        str(BUNDLED_MODEL),
        str(PRESETS / "gvote.yaml"),
        "127.0.0.1",
        8123,
    )
    assert (args.kv_memory, args.max_num_seqs, args.max_model_len, args.max_queue) == (64 << 20, 4, 512, 8)


def test_cpu_command_defaults_and_policy_resolution(tmp_path: Path) -> None:
    # Nothing set: the bundled model, no policy flag (full), every interface.
    assert _command(CPU) == ["kvpress", "serve", "--host", "0.0.0.0", "--port", "8000"]
    # A name with no preset file stays a name; a path stays a path; a positional argument is the model.
    assert _command(CPU, KVPRESS_KV_POLICY="snapkv", KVPRESS_PRESETS_DIR=str(tmp_path))[2:4] == [
        "--kv-policy",
        "snapkv",
    ]
    preset = tmp_path / "mine.yaml"
    preset.write_text("name: snapkv\nratio: 0.5\n")
    assert _command(CPU, KVPRESS_KV_POLICY="mine", KVPRESS_PRESETS_DIR=str(tmp_path))[3] == str(preset)
    assert _command(CPU, KVPRESS_KV_POLICY=str(preset))[3] == str(preset)
    argv = _command(CPU, str(BUNDLED_MODEL), "--num-pages", "64", KVPRESS_MODEL_DIR="/ignored")
    assert argv[2] == str(BUNDLED_MODEL) and argv[-2:] == ["--num-pages", "64"]


def test_vllm_command_from_every_variable(tmp_path: Path) -> None:
    (tmp_path / "gvote.yaml").write_text("name: gvote\n")
    argv = _command(
        VLLM,
        "--enforce-eager",
        KVPRESS_MODEL_DIR="/models/model",
        KVPRESS_KV_POLICY="gvote",
        KVPRESS_PRESETS_DIR=str(tmp_path),
        KVPRESS_PORT="9000",
        KVPRESS_MAX_NUM_SEQS="32",
        KVPRESS_MAX_MODEL_LEN="4096",
        KVPRESS_SERVED_MODEL_NAME="model",
        KVPRESS_GPU_MEMORY_UTILIZATION="0.85",
    )
    assert argv == [
        "vllm", "serve", "/models/model",
        "--kv-policy", str(tmp_path / "gvote.yaml"),
        "--host", "0.0.0.0", "--port", "9000",
        "--max-num-seqs", "32", "--max-model-len", "4096",
        "--served-model-name", "model", "--gpu-memory-utilization", "0.85",
        "--enforce-eager",
    ]  # fmt: skip
    # JSON policies pass through untouched; no policy means plain vLLM (the plugin stays inactive).
    policy = '{"name": "snapkv", "ratio": 0.1}'
    assert _command(VLLM, "/m", KVPRESS_KV_POLICY=policy, KVPRESS_PRESETS_DIR=str(tmp_path))[3:5] == [
        "--kv-policy",
        policy,
    ]
    assert "--kv-policy" not in _command(VLLM, "/m")


@pytest.mark.parametrize(
    ("script", "args", "variables", "message"),
    [
        (CPU, (), {"KVPRESS_PORT": "http"}, "KVPRESS_PORT must be an integer"),
        (CPU, (), {"KVPRESS_PORT": "0"}, "KVPRESS_PORT must be between 1 and 65535"),
        (CPU, (), {"KVPRESS_PORT": "65536"}, "KVPRESS_PORT must be between 1 and 65535"),
        (CPU, (), {"KVPRESS_NUM_PAGES": "-3"}, "KVPRESS_NUM_PAGES must be an integer"),
        (CPU, (), {"KVPRESS_MAX_NUM_SEQS": "1e3"}, "KVPRESS_MAX_NUM_SEQS must be an integer"),
        (CPU, (), {"KVPRESS_KV_MEMORY": "1GiB", "KVPRESS_NUM_PAGES": "8"}, "not both"),
        (CPU, ("/nonexistent/model",), {}, "has no config.json"),
        (CPU, (), {"KVPRESS_MODEL_DIR": "/nonexistent/model"}, "has no config.json"),
        (VLLM, (), {}, "no model"),
        (VLLM, ("/m",), {"KVPRESS_PORT": "80x"}, "KVPRESS_PORT must be an integer"),
        (VLLM, ("/m",), {"KVPRESS_GPU_MEMORY_UTILIZATION": "1.5"}, "must be a fraction"),
        (VLLM, ("/m",), {"KVPRESS_GPU_MEMORY_UTILIZATION": "90%"}, "must be a fraction"),
        (VLLM, ("/m",), {"KVPRESS_MAX_MODEL_LEN": "big"}, "KVPRESS_MAX_MODEL_LEN must be an integer"),
    ],
)
def test_bad_variables_are_refused(
    script: Path, args: tuple[str, ...], variables: dict[str, str], message: str
) -> None:
    assert message in _refused(script, *args, **variables)


def test_healthcheck_fails_without_a_server() -> None:
    result = subprocess.run(
        [sys.executable, str(HEALTHCHECK)],
        env=_env(KVPRESS_PORT=str(_free_port())),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 1 and "health check" in result.stderr


def test_cpu_entrypoint_with_the_cpu_overlay_environment_serves(tmp_path: Path) -> None:
    objects = render(K8S / "overlays" / "cpu")
    env = container_env(server_container(objects))
    presets_dir = tmp_path / "presets"
    presets_dir.mkdir()
    for filename, text in one(objects, "ConfigMap")["data"].items():
        (presets_dir / filename).write_text(text)
    port = _free_port()
    env.update(KVPRESS_PRESETS_DIR=str(presets_dir), KVPRESS_HOST="127.0.0.1", KVPRESS_PORT=str(port))
    url = f"http://127.0.0.1:{port}"

    command = _command(CPU, **env)
    assert command[:2] == ["kvpress", "serve"] and str(presets_dir / f"{env['KVPRESS_KV_POLICY']}.yaml") in command

    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen([str(CPU)], env=_env(**env), stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while True:
            health = subprocess.run(
                [sys.executable, str(HEALTHCHECK)], env=_env(KVPRESS_PORT=str(port)), capture_output=True, check=False
            )
            if health.returncode == 0:
                break
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, "server not healthy after 120 s"
            time.sleep(0.5)

        with httpx.Client(base_url=url, timeout=60) as client:
            answer = client.post(
                "/v1/completions",
                json={"prompt": "key trout is 65 . what is key trout ? answer :", "max_tokens": 4, "temperature": 0},
            )
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert body["choices"][0]["finish_reason"] in ("stop", "length")
            assert body["usage"]["kv_policy"] == env["KVPRESS_KV_POLICY"]  # the preset's policy ran
            assert 0 < body["usage"]["kv_retention"] < 1
            kv = client.get("/debug/kv").json()
            page_bytes = kv["page_bytes"]
            assert kv["pages_total"] * page_bytes == parse_size(env["KVPRESS_KV_MEMORY"])  # reached the pool
            metrics = client.get("/metrics").text
            assert "kvpress_requests_waiting " in metrics
        # exec replaced the shell: the entrypoint's process is now the server itself.
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes().split(b"\0")
        assert any(part.endswith(b"kvpress") for part in cmdline)
        assert not any(part.endswith(b"entrypoint-cpu.sh") for part in cmdline)
    finally:
        # exec made the server the entrypoint's own process: SIGTERM reaches uvicorn directly.
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
            raise
        log.close()
    # uvicorn shuts down gracefully, then re-raises SIGTERM (exit 143 in a container).
    output = (tmp_path / "server.log").read_text()
    assert code in (0, -signal.SIGTERM), output
    assert "Application shutdown complete" in output


def test_the_vllm_entrypoint_spreads_one_server_over_nodes() -> None:
    """Node 0 serves HTTP; every other node runs its workers only (`--headless`); the parallel sizes pass through."""
    nodes = {"KVPRESS_NNODES": "2", "KVPRESS_MASTER_ADDR": "head", "KVPRESS_TENSOR_PARALLEL_SIZE": "2"}
    head = _command(VLLM, "/m", KVPRESS_NODE_RANK="0", **nodes)
    worker = _command(VLLM, "/m", KVPRESS_NODE_RANK="1", KVPRESS_MASTER_PORT="29500", **nodes)
    assert "--port" in head and "--headless" not in head
    assert "--headless" in worker and "--port" not in worker and worker[-2:] == ["--tensor-parallel-size", "2"]
    assert worker[worker.index("--node-rank") + 1] == "1" and worker[worker.index("--master-port") + 1] == "29500"
    assert _command(VLLM, "/m", KVPRESS_DATA_PARALLEL_SIZE="2")[-2:] == ["--data-parallel-size", "2"]
    assert _command(VLLM, "/m", KVPRESS_PIPELINE_PARALLEL_SIZE="2")[-2:] == ["--pipeline-parallel-size", "2"]
    for variables, message in (
        ({"KVPRESS_NNODES": "2", "KVPRESS_NODE_RANK": "2", "KVPRESS_MASTER_ADDR": "h"}, "between 0 and 1"),
        ({"KVPRESS_NNODES": "2"}, "needs KVPRESS_MASTER_ADDR"),
        ({"KVPRESS_TENSOR_PARALLEL_SIZE": "two"}, "must be an integer"),
    ):
        assert message in _refused(VLLM, "/m", **variables)
