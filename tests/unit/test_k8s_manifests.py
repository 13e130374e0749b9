"""deploy/k8s, offline: every overlay renders (deploy/k8s/tools/render.py, the kustomize subset
it uses) and every object validates strictly against the Kubernetes schemas of
kubernetes-validate (1.28 and the newest bundled) or, for the LeaderWorkerSet, its vendored
CRD; a broken manifest fails naming the fault. Then what the schemas cannot see, read from the
pods the manifests make (deploy/k8s/tools/pods.py): selectors and ports fit, every ConfigMap,
Secret and key a pod needs is one the manifests or the keys Job make, every CONVEYOR_* variable
is one its service reads and parses, the frontends list the engines in order by their DNS
names, NetworkPolicies admit only the frontends to a scheduler and only engine pods to the
ranks' ports, probes and drain fit the grace period, the GPU shapes ask for GPUs.
What none of this proves without a cluster: docs/deploy.md, "What the offline checks cannot
prove". Runtime: ~5 s (49 tests) on the shared 2-core machine.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import re
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from conveyor.cli_docs import _services
from deploy.k8s.tools.check import OVERLAYS_DIR, check, overlays
from deploy.k8s.tools.pods import Pod, container_env, expand, selects
from deploy.k8s.tools.render import RenderError, render
from deploy.k8s.tools.validate import CRD_DIGESTS, CRD_DIR, validate_all
from shared.config_flags import build_config, flag_spec
from shared.curve import generate_keys
from shared.env import KNOWN, PREFIX

NAMESPACE = "conveyor"
OVERLAYS = overlays()
SERVICE_MODULES = ("services.scheduler", "services.worker", "services.tokenizer",
                   "services.gateway")  # fmt: skip
# variables a service reads outside its flags: the gateway's served model name defaults to the
# name of CONVEYOR_MODEL (services/gateway/config.py)
READ_OUTSIDE_FLAGS = {"services.gateway": {"CONVEYOR_MODEL"}}
DRAIN_MARGIN_S = 10  # the grace period beyond the drain: the preStop hooks, the processes' exit


@cache
def _objects(overlay: str) -> tuple[dict[str, Any], ...]:
    return tuple(render(OVERLAYS_DIR / overlay))


def _pods(overlay: str) -> list[Pod]:
    return expand(list(_objects(overlay)), NAMESPACE)


@cache
def _secrets() -> dict[str, dict[str, bytes]]:
    """The Secrets the keys Job makes: `conveyor keys generate`'s files (deploy/k8s/base/keys),
    an API key."""
    with tempfile.TemporaryDirectory() as tmp:
        generate_keys(Path(tmp) / "keys")
        curve = {p.name: p.read_bytes() for p in (Path(tmp) / "keys").iterdir() if p.is_file()}
    return {"conveyor-curve": curve, "conveyor-api-key": {"api-key": b"test-key"}}


def _env(overlay: str, pod: Pod, container: dict[str, Any]) -> dict[str, str]:
    return container_env(pod, container, list(_objects(overlay)), _secrets())


def _module(container: dict[str, Any]) -> str:
    argv = container.get("command") or []
    return argv[2] if argv[:2] == ["python", "-m"] else ""


def _running(overlay: str, module: str) -> list[tuple[Pod, dict[str, Any]]]:
    return [(p, c) for p in _pods(overlay) for c in p.containers() if _module(c) == module]


# ---- schemas --------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay: str) -> None:
    assert check(overlay) == []
    kinds = {o["kind"] for o in _objects(overlay)}
    engine = "LeaderWorkerSet" if overlay == "tensor-parallel" else "StatefulSet"
    assert {engine, "Deployment", "Service", "Job", "NetworkPolicy",
            "PodDisruptionBudget", "ConfigMap", "Role", "RoleBinding"} <= kinds  # fmt: skip


def _obj(overlay: str, kind: str, name: str) -> dict[str, Any]:
    return copy.deepcopy(next(o for o in _objects(overlay)
                              if o["kind"] == kind and o["metadata"]["name"] == name))  # fmt: skip


def _lws_worker(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]


BROKEN: list[tuple[str, str, str, Callable[[dict], Any], str]] = [
    ("cpu", "Deployment", "frontend",
     lambda o: o["spec"]["template"]["spec"]["containers"][0].update(comand=["x"]),
     "Additional properties are not allowed ('comand' was unexpected)"),
    ("cpu", "StatefulSet", "engine", lambda o: o["spec"].update(replicas="two"),
     "spec.replicas: 'two' is not of type 'integer'"),
    ("cpu", "Service", "engine", lambda o: o["spec"]["ports"][0].update(port="5556/tcp"),
     "spec.ports.0.port: '5556/tcp' is not of type 'integer'"),
    ("cpu", "Deploymnet", "frontend", lambda o: None, "no schema, not validated"),
    ("tensor-parallel", "LeaderWorkerSet", "engine",
     lambda o: o["spec"]["leaderWorkerTemplate"].update(restartPolicy="Sometimes"),
     "'Sometimes' is not one of"),
    ("tensor-parallel", "LeaderWorkerSet", "engine",
     lambda o: _lws_worker(o).update(imagePullPolice="Always"),
     "('imagePullPolice' was unexpected) (CRD schema)"),
    ("tensor-parallel", "LeaderWorkerSet", "engine",
     lambda o: o["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"].update(label={}),
     "workerTemplate.metadata: Additional properties are not allowed ('label' was unexpected)"),
]  # fmt: skip


@pytest.mark.parametrize("overlay, kind, name, change, reason", BROKEN,
                         ids=[f"{b[1]}-{b[4][:24]}" for b in BROKEN])  # fmt: skip
def test_a_broken_manifest_fails_with_its_reason(overlay, kind, name, change, reason) -> None:
    """The validators are real: the same object with one mistake fails, naming it."""
    obj = _obj(overlay, "Deployment" if kind == "Deploymnet" else kind, name)
    obj["kind"] = kind
    change(obj)
    problems = validate_all([obj])
    assert problems and any(reason in p for p in problems), problems


def test_the_vendored_crd_is_the_release_its_readme_names() -> None:
    readme = (CRD_DIR / "README.md").read_text()
    for file, digest in CRD_DIGESTS.items():
        assert hashlib.sha256((CRD_DIR / file).read_bytes()).hexdigest() == digest
        assert file in readme and digest in readme


REFUSED = [
    ("patches:\n  - target: {kind: StatefulSet, name: engine}\n    patch: |-\n"
     "      - {op: test, path: /spec/template/spec/containers/0/name, value: worker}\n",
     "test failed: found 'scheduler'"),
    ("patches:\n  - target: {kind: StatefulSet, name: engine}\n    patch: |-\n"
     "      spec: {replicas: 2}\n", "only JSON 6902 patches"),
    ("patches:\n  - target: {kind: Deployment, name: engine}\n    patch: '[]'\n",
     "matches nothing"),
    ("images:\n  - {name: conveyor, newTag: v2}\n", "not supported by this renderer: images"),
    ("configMapGenerator:\n  - {name: conveyor-worker, behavior: merge, literals: ['A=\"b\"']}\n",
     "quoted values are not supported"),
]  # fmt: skip


@pytest.mark.parametrize("extra, reason", REFUSED, ids=[r[1][:20] for r in REFUSED])
def test_the_renderer_refuses_what_it_cannot_render(
    tmp_path: Path, extra: str, reason: str
) -> None:
    base = OVERLAYS_DIR.parent
    (tmp_path / "kustomization.yaml").write_text(
        f"resources:\n  - {base / 'base'}\n  - {base / 'engine' / 'statefulset'}\n{extra}"
    )
    with pytest.raises(RenderError, match=re.escape(reason)):
        render(tmp_path)


# ---- what the schemas cannot see ------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_and_ports_fit(overlay: str) -> None:
    pods = _pods(overlay)
    for obj in _objects(overlay):
        spec, name = obj.get("spec") or {}, f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in ("Deployment", "StatefulSet"):
            assert selects(spec["selector"], spec["template"]["metadata"]["labels"]), name
        selector = {"Service": spec.get("selector"), "PodDisruptionBudget": spec.get("selector"),
                    "NetworkPolicy": spec.get("podSelector")}.get(obj["kind"])  # fmt: skip
        if selector is None:
            continue
        chosen = [p for p in pods if selects(selector, p.labels)]
        assert chosen, f"{name} selects no pod"
        for port in spec.get("ports", []) if obj["kind"] == "Service" else []:
            named = {p["name"] for pod in chosen for c in pod.containers()
                     for p in c.get("ports", [])}  # fmt: skip
            assert port["targetPort"] in named, f"{name}: no pod has port {port['targetPort']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_and_setting_a_pod_needs_exists(overlay: str) -> None:
    """ConfigMaps from the manifests, Secrets and their keys as the keys Job makes them: a
    missing one would leave the pod in ContainerCreating."""
    secrets = _secrets()
    for pod in _pods(overlay):
        for container in pod.containers() + pod.containers(init=True):
            _env(overlay, pod, container)  # raises KeyError for anything missing
        for volume in pod.spec.get("volumes") or []:
            sources = [s["secret"] for s in (volume.get("projected") or {}).get("sources", [])]
            for source in sources + ([volume["secret"]] if "secret" in volume else []):
                keys = {i["key"] for i in source.get("items") or []}
                assert keys <= set(
                    secrets[source["secretName" if "secretName" in source else "name"]]
                ), (pod.name, volume["name"])


def _service_variables(parser: argparse.ArgumentParser) -> set[str]:
    flags = [flag_spec(a) for a in parser._actions]
    return {PREFIX + e for f in flags if f is not None for e in f.envs} | {
        PREFIX + k for k in KNOWN
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_is_one_its_service_reads_and_parses(overlay: str) -> None:
    """A CONVEYOR_* name the service does not read is a typo that would be silently ignored;
    each service's own parser builds its configs from the container's environment (values
    checked as at start-up)."""
    parsers = {name.split()[-1]: make for name, make in _services()}
    for module in SERVICE_MODULES:
        running = _running(overlay, module)
        assert running, f"{overlay}: nothing runs {module}"
        parser = parsers[module]()
        known = _service_variables(parser) | READ_OUTSIDE_FLAGS.get(module, set())
        flags = [f for f in map(flag_spec, parser._actions) if f is not None]
        roots = {f.owner for f in flags if len(f.path) == 1}  # the service's own configs
        for pod, container in running:
            env = _env(overlay, pod, container)
            unknown = sorted(k for k in env if k.startswith(PREFIX) and k not in known)
            assert not unknown, f"{pod.name}/{container['name']} ({module}): {unknown}"
            args = parser.parse_args([])
            for root in roots:
                build_config(root, args, env=env)  # ValueError on a bad value


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_frontends_list_every_engine_in_order(overlay: str) -> None:
    """Engine i is the pod whose scheduler says CONVEYOR_ENGINE=i, reached as
    <pod>.<headless Service>:5556, the i-th address of every frontend."""
    schedulers = sorted(((int(_env(overlay, p, c)["CONVEYOR_ENGINE"]), p)
                         for p, c in _running(overlay, "services.scheduler")),
                        key=lambda e: e[0])  # fmt: skip
    assert [i for i, _ in schedulers] == list(range(len(schedulers)))
    headless = {o["metadata"]["name"] for o in _objects(overlay)
                if o["kind"] == "Service" and o["spec"].get("clusterIP") == "None"}  # fmt: skip
    want = [f"tcp://{p.name}.{p.subdomain}:5556" for _, p in schedulers]
    assert all(p.subdomain in headless for _, p in schedulers)
    for pod, container in _running(overlay, "services.tokenizer"):
        assert _env(overlay, pod, container)["CONVEYOR_SCHEDULER_ADDRS"].split(",") == want
    if overlay == "data-parallel":
        assert len(want) == 2


# ---- exposure: who may connect where (NetworkPolicies) -------------------------------------

ANYONE = "anyone"  # a peer outside the pods (no `from`, an ipBlock, another namespace)
LOOPBACK = "tcp://127.0.0.1:"


def _allowed(overlay: str, dst: Pod, port: int) -> set[str]:
    """Who may open a TCP connection to `dst` on `port`: pod names, or ANYONE."""
    pods = _pods(overlay)
    policies = [o["spec"] for o in _objects(overlay) if o["kind"] == "NetworkPolicy"
                and "Ingress" in o["spec"].get("policyTypes", ["Ingress"])
                and selects(o["spec"]["podSelector"], dst.labels)]  # fmt: skip
    if not policies:
        return {ANYONE} | {p.name for p in pods}
    named = {p["name"]: p["containerPort"] for c in dst.containers() for p in c.get("ports", [])}
    out: set[str] = set()
    for rule in [r for spec in policies for r in spec.get("ingress") or []]:
        ports = [named.get(p.get("port"), p.get("port")) for p in rule.get("ports") or []]
        if ports and port not in ports:
            continue
        for peer in rule.get("from") or [{}]:
            if set(peer) == {"podSelector"}:
                out |= {p.name for p in pods if selects(peer["podSelector"], p.labels)}
            else:
                out |= {ANYONE} | {p.name for p in pods}
    return out


def _component(overlay: str, names: set[str]) -> set[str]:
    by_name = {p.name: p.labels.get("app.kubernetes.io/component", "?") for p in _pods(overlay)}
    return {by_name.get(n, n) for n in names}


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_frontends_reach_a_scheduler_and_only_engine_pods_the_ranks(overlay: str) -> None:
    """The compose file's internal network, as NetworkPolicies: every pod is under a policy;
    the scheduler port admits frontends (and, with tensor parallelism, the group's pods);
    the worker socket binds the pod's loopback unless ranks in other pods need it, and then
    admits engine pods alone, as does the ranks' rendezvous; only the frontend and the
    gateway ports admit anyone (CURVE and the API key guard them)."""
    for pod in _pods(overlay):
        assert ANYONE not in _allowed(overlay, pod, 1), f"{pod.name}: no policy covers it"
    for pod, container in _running(overlay, "services.scheduler"):
        env = _env(overlay, pod, container)
        admitted = _allowed(overlay, pod, _port(env["CONVEYOR_SCHEDULER_ADDR"]))
        assert _component(overlay, admitted) <= {"frontend", "engine"}, pod.name
        worker_addr = env["CONVEYOR_WORKER_ADDR"]
        ranks = [(p, _env(overlay, p, c)) for p, c in _running(overlay, "services.worker")]
        remote_ranks = [
            p
            for p, e in ranks
            if p is not pod and not e["CONVEYOR_WORKER_ADDR"].startswith(LOOPBACK)
        ]
        assert worker_addr.startswith(LOOPBACK) or remote_ranks, worker_addr
        assert _component(overlay, _allowed(overlay, pod, _port(worker_addr))) <= {"engine"}
    for pod, container in _running(overlay, "services.worker"):
        dist = _env(overlay, pod, container).get("CONVEYOR_DIST_INIT")
        if dist is not None:
            assert _component(overlay, _allowed(overlay, pod, _port(dist))) <= {"engine"}
    open_ports = {
        (p.labels["app.kubernetes.io/component"], port)
        for p in _pods(overlay)
        for port in (5557, 8000, 5556, 5558, 29500)
        if ANYONE in _allowed(overlay, p, port)
    }
    assert open_ports == {("frontend", 5557), ("gateway", 8000)}


# ---- drain, probes, GPUs --------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_stopping_pod_drains_within_its_grace_period(overlay: str) -> None:
    """SIGTERM drains the scheduler and the frontend for CONVEYOR_DRAIN_TIMEOUT; the pod's
    grace period covers it; the scheduler's preStop is the drain's seam (one command); every
    worker's preStop waits for its ready file to go (the scheduler stops it after the drain)."""
    for module in ("services.scheduler", "services.tokenizer"):
        for pod, container in _running(overlay, module):
            drain = float(_env(overlay, pod, container)["CONVEYOR_DRAIN_TIMEOUT"])
            assert pod.spec["terminationGracePeriodSeconds"] >= drain + DRAIN_MARGIN_S, pod.name
    for pod, container in _running(overlay, "services.scheduler"):
        assert container["lifecycle"]["preStop"]["exec"]["command"], pod.name
    for pod, container in _running(overlay, "services.worker"):
        ready = _env(overlay, pod, container)["CONVEYOR_READY_FILE"]
        wait = container["lifecycle"]["preStop"]["exec"]["command"]
        assert wait[:2] == ["sh", "-c"] and f"while test -f {ready};" in wait[2], wait


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_has_its_probes(overlay: str) -> None:
    """Startup, readiness and liveness on every service; the worker's look for its ready file
    and its startup probe allows 10 minutes of model load."""
    for module in SERVICE_MODULES:
        for pod, container in _running(overlay, module):
            where = f"{pod.name}/{container['name']}"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probe in container, f"{where}: no {probe}"
            if module != "services.worker":
                continue
            ready = _env(overlay, pod, container)["CONVEYOR_READY_FILE"]
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert container[probe]["exec"]["command"] == ["test", "-f", ready], where
            startup = container["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpu_shapes_give_every_worker_a_gpu(overlay: str) -> None:
    on_gpu = overlay != "cpu"
    for pod, container in _running(overlay, "services.worker"):
        gpus = int(container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        device = _env(overlay, pod, container)["CONVEYOR_DEVICE"]
        assert (gpus, device) == ((1, "cuda") if on_gpu else (0, "cpu")), pod.name
    for pod in _pods(overlay):
        for container in pod.containers():
            assert container.get("resources", {}).get("requests"), f"{pod.name}: no requests"
