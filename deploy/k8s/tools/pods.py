"""The pods that rendered manifests make, as the cluster's controllers and kubelet would make
them: names, labels, DNS names, and each container's environment and command line. The offline
checks reason about pods with it (NetworkPolicies, addresses), and the tests run each
container as a plain process from it (tests/e2e/test_k8s_processes.py).

    for pod in expand(objects, namespace="conveyor"):
        env = container_env(pod, container, objects, secrets)   # what the process gets
        argv = container_argv(container, env)                   # $(VAR) expanded

What the controllers add is modelled on their documented behaviour: a StatefulSet's pods are
<name>-<i> with the apps.kubernetes.io/pod-index label; a LeaderWorkerSet's group i is the leader
<name>-<i> and workers <name>-<i>-<w> with the leaderworkerset.sigs.k8s.io labels and the
LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX variables first in every container (as
lws v0.9.0's pod webhook puts them); a Deployment's or Job's pods are <name>-<i> here (the
cluster adds random suffixes).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

LWS = "leaderworkerset.sigs.k8s.io"
VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
LABEL_FIELD = re.compile(r"metadata\.labels\['([^']+)'\]")


@dataclass(frozen=True)
class Pod:
    name: str
    workload: str  # "StatefulSet/engine"
    labels: dict[str, str]
    spec: dict[str, Any]  # the pod template's spec
    namespace: str
    subdomain: Optional[str] = None  # its headless Service: DNS name <name>.<subdomain>
    injected_env: dict[str, str] = field(default_factory=dict)  # by a controller, listed first

    def containers(self, init: bool = False) -> list[dict[str, Any]]:
        return list(self.spec.get("initContainers" if init else "containers") or [])

    def container(self, name: str) -> dict[str, Any]:
        return next(c for c in self.containers() + self.containers(True) if c["name"] == name)


def expand(
    objects: list[dict[str, Any]], namespace: str, replicas: Optional[Mapping[str, int]] = None
) -> list[Pod]:
    """Every pod the workloads make; `replicas` overrides a Deployment's count by name (a test
    may run one frontend of two)."""
    replicas = replicas or {}
    pods: list[Pod] = []
    for obj in objects:
        kind, name = obj["kind"], obj["metadata"]["name"]
        spec = obj.get("spec") or {}
        if kind == "Deployment":
            count = replicas.get(name, spec.get("replicas", 1))
            pods += [_pod(f"{name}-{i}", obj, spec["template"], namespace) for i in range(count)]
        elif kind == "Job":
            pods.append(_pod(f"{name}-0", obj, spec["template"], namespace))
        elif kind == "StatefulSet":
            for i in range(spec.get("replicas", 1)):
                labels = {"apps.kubernetes.io/pod-index": str(i),
                          "statefulset.kubernetes.io/pod-name": f"{name}-{i}"}  # fmt: skip
                pods.append(_pod(f"{name}-{i}", obj, spec["template"], namespace, labels,
                                 subdomain=spec.get("serviceName")))  # fmt: skip
        elif kind == "LeaderWorkerSet":
            pods += _lws_pods(obj, namespace)
    return pods


def _pod(
    name: str,
    owner: dict[str, Any],
    template: dict[str, Any],
    namespace: str,
    extra_labels: Optional[dict[str, str]] = None,
    subdomain: Optional[str] = None,
    injected_env: Optional[dict[str, str]] = None,
) -> Pod:
    labels = {**(template.get("metadata") or {}).get("labels", {}), **(extra_labels or {})}
    return Pod(name, f"{owner['kind']}/{owner['metadata']['name']}", labels, template["spec"],
               namespace, subdomain, dict(injected_env or {}))  # fmt: skip


def _lws_pods(obj: dict[str, Any], namespace: str) -> list[Pod]:
    name, spec = obj["metadata"]["name"], obj["spec"]
    group_template = spec["leaderWorkerTemplate"]
    size = group_template.get("size", 1)
    worker = group_template["workerTemplate"]
    leader = group_template.get("leaderTemplate") or worker
    pods = []
    for group in range(spec.get("replicas", 1)):
        env = {"LWS_LEADER_ADDRESS": f"{name}-{group}.{name}.{namespace}",
               "LWS_GROUP_SIZE": str(size)}  # fmt: skip
        for index in range(size):
            labels = {f"{LWS}/name": name, f"{LWS}/group-index": str(group),
                      f"{LWS}/worker-index": str(index)}  # fmt: skip
            pod_name = f"{name}-{group}" if index == 0 else f"{name}-{group}-{index}"
            template = leader if index == 0 else worker
            pods.append(_pod(pod_name, obj, template, namespace, labels, subdomain=name,
                             injected_env={**env, "LWS_WORKER_INDEX": str(index)}))  # fmt: skip
    return pods


def container_env(
    pod: Pod,
    container: dict[str, Any],
    objects: list[dict[str, Any]],
    secrets: Mapping[str, Mapping[str, bytes]],
) -> dict[str, str]:
    """The environment the kubelet gives `container`: a controller's variables, then envFrom in
    order, then env in order (a later one wins), each value's $(VAR) expanded with the variables
    before it; `secrets`: name -> key -> bytes. Raises KeyError for a missing ConfigMap, Secret
    or key (the pod would not start)."""
    env: dict[str, str] = dict(pod.injected_env)
    for source in container.get("envFrom") or []:
        ref = source.get("configMapRef") or source.get("secretRef")
        data = _config_map(objects, ref["name"]) if "configMapRef" in source else {
            k: v.decode() for k, v in secrets[ref["name"]].items()}  # fmt: skip
        env.update({source.get("prefix", "") + k: v for k, v in data.items()})
    for var in container.get("env") or []:
        if "valueFrom" in var:
            env[var["name"]] = _value_from(pod, var["valueFrom"], objects, secrets)
        else:
            env[var["name"]] = expand_refs(var.get("value", ""), env)
    return env


def container_argv(container: dict[str, Any], env: Mapping[str, str]) -> list[str]:
    """command + args with $(VAR) expanded from the container's environment."""
    words = (container.get("command") or []) + (container.get("args") or [])
    return [expand_refs(word, env) for word in words]


def expand_refs(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a known variable is replaced, an unknown one stays as
    written, $$ is one $."""

    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return VAR_REF.sub(one, text)


def _value_from(
    pod: Pod,
    source: dict[str, Any],
    objects: list[dict[str, Any]],
    secrets: Mapping[str, Mapping[str, bytes]],
) -> str:
    if "fieldRef" in source:
        path = source["fieldRef"]["fieldPath"]
        if path == "metadata.name":
            return pod.name
        if path == "metadata.namespace":
            return pod.namespace
        label = LABEL_FIELD.fullmatch(path)
        if label is None:
            raise KeyError(f"fieldRef {path} is not modelled")
        return pod.labels[label.group(1)]
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        return _config_map(objects, ref["name"])[ref["key"]]
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        return secrets[ref["name"]][ref["key"]].decode()
    raise KeyError(f"valueFrom {sorted(source)} is not modelled")


def _config_map(objects: list[dict[str, Any]], name: str) -> dict[str, str]:
    for obj in objects:
        if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] == name:
            binary = obj.get("binaryData") or {}
            data = dict(obj.get("data") or {})
            data.update({k: base64.b64decode(v).decode() for k, v in binary.items()})
            return data
    raise KeyError(f"ConfigMap {name} is not in the manifests")


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist, or a
    Service's plain map) against a pod's labels."""
    structured = "matchLabels" in selector or "matchExpressions" in selector
    match = selector.get("matchLabels") or {} if structured else selector
    if any(labels.get(k) != v for k, v in match.items()):
        return False
    for expr in selector.get("matchExpressions") or [] if structured else []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]  # fmt: skip
        if not ok:
            return False
    return True
