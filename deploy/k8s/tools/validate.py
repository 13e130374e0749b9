"""Offline schema validation of rendered manifests, strict like the API server's field validation
(an unknown field is an error, not dropped):

* built-in kinds against the Kubernetes JSON schemas that kubernetes-validate (PyPI) bundles,
  its strict variant, for each version in KUBERNETES_VERSIONS;
* custom resources against the openAPIV3Schema of their CRD, vendored in deploy/k8s/crds/
  (source and digest in its README), turned into a strict JSON Schema the same way: objects
  with listed properties admit no others (unless x-kubernetes-preserve-unknown-fields), and
  every `metadata` the CRD leaves open is checked as the Kubernetes ObjectMeta.

A kind that neither knows is an error: nothing is skipped.

    problems = validate_all(objects)      # [] when every object is valid
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate import utils as kv_utils
from referencing import Registry, Resource

CRD_DIR = Path(__file__).resolve().parents[1] / "crds"
# The oldest Kubernetes the manifests are for (StatefulSet pods' apps.kubernetes.io/pod-index
# label) and the newest whose schemas kubernetes-validate bundles.
MIN_KUBERNETES = "1.28"
# Vendored CRDs, file -> sha256 (deploy/k8s/crds/README.md names their sources).
CRD_DIGESTS = {
    "leaderworkerset.x-k8s.io_leaderworkersets.yaml":
        "92382b4a4eac032dbbce7eb9bb1e4e7e99880a30656f90649aeb284ce9dc732a",
}  # fmt: skip
OBJECT_META = "https://kubernetes.io/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"  # noqa: E501


def kubernetes_versions() -> tuple[str, ...]:
    """The versions every built-in object is checked against."""
    return (MIN_KUBERNETES, kubernetes_validate.latest_version())


def validate_all(objects: list[dict[str, Any]]) -> list[str]:
    """One line per problem: `Kind/name: where: what (against which schema)`."""
    crds = custom_schemas()
    problems = []
    for obj in objects:
        name = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
        key = (obj.get("apiVersion"), obj.get("kind"))
        if key in crds:
            problems += [f"{name}: {p} (CRD schema)" for p in _errors(crds[key], obj)]
            continue
        for version in kubernetes_versions():
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path) or "(top)"
                problems.append(f"{name}: {where}: {exc.message} (Kubernetes {exc.version})")
            except kv_utils.SchemaNotFoundError as exc:
                problems.append(f"{name}: {exc.message}: no schema, not validated")
                break
    return problems


def _errors(validator: jsonschema.protocols.Validator, obj: dict[str, Any]) -> list[str]:
    found = sorted(validator.iter_errors(obj), key=lambda e: list(e.path))
    return [f"{'.'.join(str(p) for p in e.path) or '(top)'}: {e.message}" for e in found]


@cache
def custom_schemas() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """(apiVersion, kind) -> a strict validator, for every version served by a vendored CRD.
    Raises ValueError when a vendored file is not the one its digest names."""
    registry = Resource.from_contents(_definitions()) @ Registry()
    out = {}
    for file, digest in CRD_DIGESTS.items():
        raw = (CRD_DIR / file).read_bytes()
        if hashlib.sha256(raw).hexdigest() != digest:
            raise ValueError(f"{CRD_DIR / file} is not the vendored file its digest names")
        crd = yaml.load(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        spec = crd["spec"]
        for version in spec["versions"]:
            schema = strict_schema(version["schema"]["openAPIV3Schema"])
            schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
            api_version = f"{spec['group']}/{version['name']}"
            validator = jsonschema.Draft202012Validator(schema, registry=registry)
            out[(api_version, spec["names"]["kind"])] = validator
    return out


def strict_schema(node: Any) -> Any:
    """A CRD's OpenAPI v3 (structural) schema as a strict JSON Schema."""
    if isinstance(node, list):
        return [strict_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    skip = ("nullable", "properties")
    out = {k: strict_schema(v) for k, v in node.items()
           if not k.startswith("x-kubernetes-") and k not in skip}  # fmt: skip
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    elif node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if isinstance(node.get("properties"), dict):
        props = {k: strict_schema(v) for k, v in node["properties"].items()}
        meta = props.get("metadata")
        if isinstance(meta, dict) and "properties" not in meta and meta.get("type") == "object":
            props["metadata"] = {"$ref": OBJECT_META}  # ObjectMeta, where the CRD leaves it open
        out["properties"] = props
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
    return out


def _definitions() -> dict[str, Any]:
    """kubernetes-validate's shared strict definitions (ObjectMeta and the rest)."""
    version = kubernetes_validate.latest_version()
    path = f"kubernetes-json-schema/v{version}-local-strict/_definitions.json"
    return kv_utils.schema_contents(path, version)
