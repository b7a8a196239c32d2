"""The kustomize tree under docker/k8s: it renders, validates against Kubernetes' schemas, and agrees
with the server it deploys (probe routes, ports, metric names, policy presets)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_utils import (
    DOCKER,
    K8S,
    KUBERNETES_VERSION,
    OVERLAYS,
    REPO,
    container_env,
    one,
    printed_command,
    render,
    render_with_autoscaling,
    server_container,
)

from vllm_kvpress_ext.cli import build_parser
from vllm_kvpress_ext.policies import load_policy
from vllm_kvpress_ext.server.metrics import ServerMetrics
from vllm_kvpress_ext.server.routes import router

TARGETS = ("base", *(f"overlays/{name}" for name in OVERLAYS))


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {target: render(K8S / target) for target in TARGETS}


def _server_routes() -> set[str]:
    return {getattr(route, "path", "") for route in router.routes}


def _exported_metric_names() -> set[str]:
    """Names as Prometheus exposes them: counters gain `_total`, gauges keep theirs."""
    names = set()
    for family in ServerMetrics().registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def _pod_spec(objects: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = one(objects, "Deployment")["spec"]["template"]["spec"]
    return spec


@pytest.mark.parametrize("target", TARGETS)
def test_every_rendered_object_validates_strictly(rendered: dict[str, list[dict[str, Any]]], target: str) -> None:
    for obj in rendered[target]:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_autoscaling_component_renders_and_validates(tmp_path: Path) -> None:
    for overlay in OVERLAYS:
        scratch = tmp_path / overlay
        scratch.mkdir()
        objects = render_with_autoscaling(overlay, scratch)
        for obj in objects:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        hpa = one(objects, "HorizontalPodAutoscaler")
        deployment = one(objects, "Deployment")
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])


def test_autoscaler_metric_is_one_the_server_exports(tmp_path: Path) -> None:
    hpa = one(render_with_autoscaling("cpu", tmp_path), "HorizontalPodAutoscaler")
    names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert names, "the autoscaler should scale on a per-pod KV metric"
    exported = _exported_metric_names()
    for name in names:
        assert name in exported, f"HPA metric {name} is not among the server's metrics"


def test_a_bad_manifest_fails_validation() -> None:
    # The validator is strict: a misspelt field is an error, so the passing tests above mean something.
    deployment = one(render(K8S / "base"), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("target", TARGETS)
def test_probes_hit_the_health_route(rendered: dict[str, list[dict[str, Any]]], target: str) -> None:
    container = server_container(rendered[target])
    routes = _server_routes()
    port_names = {p["name"] for p in container["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and get["path"] in routes, f"{probe} path {get['path']}"
        assert get["port"] in port_names, f"{probe} port {get['port']} is not a container port"


@pytest.mark.parametrize("target", TARGETS)
def test_ports_agree_across_service_deployment_and_server(
    rendered: dict[str, list[dict[str, Any]]], target: str
) -> None:
    objects = rendered[target]
    container = server_container(objects)
    env = container_env(container)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    server_port = int(env["KVPRESS_PORT"])  # the entrypoint turns this into --port
    assert ports == {"http": server_port}
    assert env["KVPRESS_HOST"] == "0.0.0.0"  # reachable from the Service, not only from inside the pod

    service = one(objects, "Service")
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] in ("http", server_port)
    deployment = one(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    pdb = one(objects, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()

    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == server_port
    assert annotations["prometheus.io/path"] == "/metrics" and "/metrics" in _server_routes()


@pytest.mark.parametrize("target", TARGETS)
def test_configmap_presets_are_the_repository_presets_and_load(
    rendered: dict[str, list[dict[str, Any]]], target: str, tmp_path: Path
) -> None:
    objects = rendered[target]
    configmap = one(objects, "ConfigMap")
    shipped = {path.name: path.read_text() for path in sorted((REPO / "configs").glob("*.yaml"))}
    assert configmap["data"] == shipped, "docker/k8s/base/presets/ must equal configs/ (cp configs/*.yaml there)"
    for filename, text in configmap["data"].items():
        preset = tmp_path / filename
        preset.write_text(text)
        policy = load_policy(str(preset))
        assert policy is not None and policy.name == yaml.safe_load(text)["name"]

    # The pod mounts this ConfigMap where the entrypoint looks for presets, and the default policy is one.
    pod = _pod_spec(objects)
    container = server_container(objects)
    env = container_env(container)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = [m for m in container["volumeMounts"] if m["mountPath"] == env["KVPRESS_PRESETS_DIR"]]
    assert len(mounts) == 1 and mounts[0]["readOnly"]
    assert volumes[mounts[0]["name"]]["configMap"]["name"] == configmap["metadata"]["name"]
    assert f"{env['KVPRESS_KV_POLICY']}.yaml" in configmap["data"]


@pytest.mark.parametrize("target", TARGETS)
def test_pods_run_non_root_on_a_read_only_root(rendered: dict[str, list[dict[str, Any]]], target: str) -> None:
    objects = rendered[target]
    pod = _pod_spec(objects)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    container = server_container(objects)
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    # The one writable place the images use (HOME and caches point there).
    tmp_mounts = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert len(tmp_mounts) == 1
    assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}[tmp_mounts[0]["name"]]
    resources = container["resources"]
    assert {"cpu", "memory"} <= resources["requests"].keys() and {"cpu", "memory"} <= resources["limits"].keys()


def test_gpu_overlay_asks_for_a_gpu_and_reads_the_model_from_a_claim(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["overlays/gpu"]
    container = server_container(objects)
    pod = _pod_spec(objects)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert container["image"].startswith("vllm-kvpress-ext-vllm:")

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    env = container_env(container)
    model_mount = mounts[env["KVPRESS_MODEL_DIR"]]
    claim = volumes[model_mount["name"]]["persistentVolumeClaim"]["claimName"]
    assert claim == one(objects, "PersistentVolumeClaim")["metadata"]["name"]
    assert model_mount["readOnly"] is True


def test_cpu_overlay_serves_the_bundled_model_with_the_cpu_image(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    container = server_container(rendered["overlays/cpu"])
    assert container["image"].startswith("vllm-kvpress-ext-cpu:")
    assert "KVPRESS_MODEL_DIR" not in container_env(container)  # empty: the image's bundled model
    assert "nvidia.com/gpu" not in container["resources"]["limits"]


def test_preset_copies_match_configs() -> None:
    # kustomize reads files only below the kustomization, hence the copies; they must not drift.
    copies = {p.name: p.read_text() for p in sorted((K8S / "base" / "presets").glob("*.yaml"))}
    originals = {p.name: p.read_text() for p in sorted((REPO / "configs").glob("*.yaml"))}
    assert copies == originals, "run: cp configs/*.yaml docker/k8s/base/presets/"
    listed = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["configMapGenerator"][0]["files"]
    assert sorted(listed) == [f"presets/{name}" for name in originals]


#: Which entrypoint each overlay's image runs (docker/Dockerfile.cpu and docker/Dockerfile.vllm copy them).
ENTRYPOINTS = {"overlays/cpu": DOCKER / "entrypoint-cpu.sh", "overlays/gpu": DOCKER / "entrypoint-vllm.sh"}


@pytest.mark.parametrize("target", sorted(ENTRYPOINTS))
def test_server_flags_built_from_the_pod_env_match_the_manifests(
    rendered: dict[str, list[dict[str, Any]]], target: str, tmp_path: Path
) -> None:
    objects = rendered[target]
    container = server_container(objects)
    env = container_env(container)
    # The ConfigMap's files where the pod mounts them (moved under tmp_path, the one change).
    presets = tmp_path / "presets"
    presets.mkdir()
    for filename, text in one(objects, "ConfigMap")["data"].items():
        (presets / filename).write_text(text)
    env["KVPRESS_PRESETS_DIR"] = str(presets)
    argv = printed_command(ENTRYPOINTS[target], env={"PATH": os.environ["PATH"], **env})
    flags = dict(itertools.pairwise(argv))
    (container_port,) = [p["containerPort"] for p in container["ports"]]
    assert int(flags["--port"]) == container_port and flags["--host"] == "0.0.0.0"
    assert flags["--kv-policy"] == str(presets / f"{env['KVPRESS_KV_POLICY']}.yaml")
    if target == "overlays/cpu":
        args = build_parser().parse_args(argv[1:])
        assert args.port == container_port and args.model_dir is None  # the bundled model
    else:
        assert argv[:3] == ["vllm", "serve", env["KVPRESS_MODEL_DIR"]]
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert env["KVPRESS_MODEL_DIR"] in mounts


def test_the_two_node_server_renders_and_its_pods_agree_on_their_roles(tmp_path: Path) -> None:
    """docker/k8s/multinode: a StatefulSet of two pods, one vLLM server with tensor parallelism across them.
    The entrypoint makes pod 0 the API server and coordinator and pod 1 a headless worker, from the pod's index."""
    objects = render(K8S / "multinode")
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    assert not [obj for obj in objects if obj["kind"] in ("Deployment", "PodDisruptionBudget")]
    nodes = one(objects, "StatefulSet")
    (container,) = nodes["spec"]["template"]["spec"]["containers"]
    env = {item["name"]: item for item in container["env"]}
    literal = {name: item["value"] for name, item in env.items() if "value" in item}
    rank_from = env["KVPRESS_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert rank_from == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert nodes["spec"]["replicas"] == int(literal["KVPRESS_NNODES"]) == 2
    services = {s["metadata"]["name"]: s for s in objects if s["kind"] == "Service"}
    peers = services[nodes["spec"]["serviceName"]]
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"] is True
    assert literal["KVPRESS_MASTER_ADDR"] == f"{nodes['metadata']['name']}-0.{peers['metadata']['name']}"
    assert services["kvpress"]["spec"]["selector"]["apps.kubernetes.io/pod-index"] == "0"  # the API: pod 0 only
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert peers["spec"]["ports"][0]["port"] == ports["coordinator"] == int(literal["KVPRESS_MASTER_PORT"])
    for rank in (0, 1):
        argv = printed_command(
            DOCKER / "entrypoint-vllm.sh", env={"PATH": os.environ["PATH"], **literal, "KVPRESS_NODE_RANK": str(rank)}
        )
        flags = dict(itertools.pairwise(argv))
        assert flags["--nnodes"] == "2" and flags["--node-rank"] == str(rank)
        assert flags["--master-addr"] == literal["KVPRESS_MASTER_ADDR"] and flags["--tensor-parallel-size"] == "2"
        if rank == 0:
            assert int(flags["--port"]) == ports["http"] and "--headless" not in argv
        else:
            assert "--headless" in argv and "--port" not in argv
