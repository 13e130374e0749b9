"""The part of kustomize that deploy/k8s uses, in Python: renders an overlay offline the way
`kubectl kustomize` does, for the checks (check.py, tests/unit/test_k8s_manifests.py), since no
package registry ships a kustomize binary for this project's machines.

    objects = render(Path("deploy/k8s/overlays/gpu"))      # list of manifests (dicts)

Supported, with kustomize's meaning and order (resources, components, the kustomization's own
generators, patches, namespace):
  resources          YAML files (several documents each) and folders with a kustomization.yaml
  components         folders whose kustomization.yaml is a Component
  configMapGenerator envs (KEY=VALUE lines), files, literals; behavior create, merge, replace;
                     only with generatorOptions.disableNameSuffixHash (names stay as written)
  patches            RFC 6902 JSON patches (add, remove, replace, test), inline or from a file,
                     each with a target kind and name (group and version optional)
  namespace          on every namespaced object and on RoleBinding ServiceAccount subjects
Anything else is refused by name (RenderError): this renderer declines what it does not know
rather than render it differently. It is also stricter than kustomize in two places: a patch
whose target matches nothing, and a quoted env value (kustomize versions differ on quotes).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
KNOWN_FIELDS = {"apiVersion", "kind", "resources", "components", "configMapGenerator",
                "generatorOptions", "patches", "namespace"}  # fmt: skip
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                  "PersistentVolume", "StorageClass", "PriorityClass", "IngressClass"}  # fmt: skip


class RenderError(ValueError):
    """A kustomization this renderer cannot render (or kustomize would refuse)."""


def render(folder: Path) -> list[dict[str, Any]]:
    """Every object the kustomization in `folder` builds, in the order they were added."""
    return _build(Path(folder).resolve(), want_kind="Kustomization")


def dump(objects: list[dict[str, Any]]) -> str:
    """The objects as one multi-document YAML text (what `kubectl apply -f -` reads)."""
    return yaml.safe_dump_all(objects, sort_keys=False, default_flow_style=False)


def object_id(obj: dict[str, Any]) -> tuple[str, str, str]:
    meta = obj.get("metadata") or {}
    return (obj.get("kind", ""), meta.get("namespace", ""), meta.get("name", ""))


def _build(folder: Path, want_kind: str) -> list[dict[str, Any]]:
    spec = _kustomization(folder)
    kind = spec.get("kind", "Kustomization")
    if kind != want_kind:
        raise RenderError(f"{folder}: a {kind} where a {want_kind} belongs")
    objects: list[dict[str, Any]] = []
    for entry in spec.get("resources") or []:
        _add(objects, _load_resource(folder, entry))
    for entry in spec.get("components") or []:
        objects = _apply_component(objects, (folder / entry).resolve())
    _generate(folder, spec, objects)
    for patch in spec.get("patches") or []:
        _apply_patch(folder, patch, objects)
    if spec.get("namespace"):
        _set_namespace(objects, spec["namespace"])
    return objects


def _apply_component(objects: list[dict[str, Any]], folder: Path) -> list[dict[str, Any]]:
    """A Component adds its resources and generators, then patches everything so far."""
    spec = _kustomization(folder)
    if spec.get("kind") != "Component":
        raise RenderError(f"{folder}: components must be of kind Component")
    out = list(objects)
    for entry in spec.get("resources") or []:
        _add(out, _load_resource(folder, entry))
    _generate(folder, spec, out)
    for patch in spec.get("patches") or []:
        _apply_patch(folder, patch, out)
    return out


def _kustomization(folder: Path) -> dict[str, Any]:
    found = [folder / name for name in KUSTOMIZATION_FILES if (folder / name).is_file()]
    if len(found) != 1:
        raise RenderError(f"{folder}: expected one kustomization file, found {len(found)}")
    spec = yaml.safe_load(found[0].read_text()) or {}
    unknown = sorted(set(spec) - KNOWN_FIELDS)
    if unknown:
        raise RenderError(f"{found[0]}: not supported by this renderer: {', '.join(unknown)}")
    return spec


def _load_resource(folder: Path, entry: str) -> list[dict[str, Any]]:
    path = (folder / entry).resolve()
    if path.is_dir():
        return _build(path, want_kind="Kustomization")
    if not path.is_file():
        raise RenderError(f"{folder}: resource {entry} does not exist")
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for doc in docs:
        if not isinstance(doc, dict) or "kind" not in doc or "apiVersion" not in doc:
            raise RenderError(f"{path}: a document without kind and apiVersion")
    return copy.deepcopy(docs)  # no YAML alias shares an object between two places


def _add(objects: list[dict[str, Any]], new: list[dict[str, Any]]) -> None:
    have = {object_id(o) for o in objects}
    for obj in new:
        if object_id(obj) in have:
            raise RenderError(f"{object_id(obj)} is defined twice")
        have.add(object_id(obj))
        objects.append(obj)


def _local_file(folder: Path, name: str) -> Path:
    """A file a kustomization reads (kustomize's default rule: inside its own folder)."""
    path = (folder / name).resolve()
    if folder != path and folder not in path.parents:
        raise RenderError(f"{folder}: {name} lies outside the kustomization's folder")
    if not path.is_file():
        raise RenderError(f"{folder}: {name} does not exist")
    return path


# ---- configMapGenerator ---------------------------------------------------------------------


def _generate(folder: Path, spec: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    generators = spec.get("configMapGenerator") or []
    if generators and not (spec.get("generatorOptions") or {}).get("disableNameSuffixHash"):
        if any(g.get("behavior", "create") == "create" for g in generators):
            raise RenderError(f"{folder}: generated names need disableNameSuffixHash: true")
    for gen in generators:
        unknown = sorted(set(gen) - {"name", "behavior", "envs", "files", "literals"})
        if unknown:
            raise RenderError(f"{folder}: configMapGenerator fields not supported: {unknown}")
        data = _generator_data(folder, gen)
        existing = _find(objects, "ConfigMap", gen["name"])
        behavior = gen.get("behavior", "create")
        if behavior == "create":
            if existing is not None:
                raise RenderError(f"{folder}: ConfigMap {gen['name']} exists (use a behavior)")
            objects.append({"apiVersion": "v1", "kind": "ConfigMap",
                            "metadata": {"name": gen["name"]}, "data": data})  # fmt: skip
        elif behavior in ("merge", "replace"):
            if existing is None:
                raise RenderError(f"{folder}: no ConfigMap {gen['name']} to {behavior}")
            existing["data"] = {**existing.get("data", {}), **data} if behavior == "merge" else data
        else:
            raise RenderError(f"{folder}: unknown generator behavior {behavior!r}")


def _generator_data(folder: Path, gen: dict[str, Any]) -> dict[str, str]:
    data: dict[str, str] = {}
    for name in gen.get("envs") or []:
        for number, line in enumerate(_local_file(folder, name).read_text().splitlines(), 1):
            line = line.lstrip()
            if line and not line.startswith("#"):
                data.update([_pair(line, f"{name}:{number}")])
    for literal in gen.get("literals") or []:
        data.update([_pair(literal, f"{gen['name']} literal")])
    for name in gen.get("files") or []:
        key, _, rel = name.rpartition("=") if "=" in name else ("", "", name)
        path = _local_file(folder, rel)
        data[key or path.name] = path.read_text()
    return data


def _pair(text: str, where: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.replace("_", "a").isalnum() or key[0].isdigit():
        raise RenderError(f"{where}: expected KEY=VALUE, got {text!r}")
    if value[:1] in ("'", '"'):
        raise RenderError(f"{where}: quoted values are not supported ({text!r})")
    return key, value


def _find(objects: list[dict[str, Any]], kind: str, name: str) -> Optional[dict[str, Any]]:
    return next((o for o in objects if object_id(o)[0] == kind and object_id(o)[2] == name), None)


# ---- patches and namespace ------------------------------------------------------------------


def _apply_patch(folder: Path, patch: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    unknown = sorted(set(patch) - {"patch", "path", "target"})
    if unknown:
        raise RenderError(f"{folder}: patch fields not supported: {unknown}")
    text = patch["patch"] if "patch" in patch else _local_file(folder, patch["path"]).read_text()
    ops = yaml.safe_load(text)
    if not isinstance(ops, list):
        raise RenderError(f"{folder}: only JSON 6902 patches (a list of operations) are supported")
    targets = [o for o in objects if _matches(o, patch.get("target") or {}, folder)]
    if not targets:
        raise RenderError(f"{folder}: patch target {patch.get('target')} matches nothing")
    for obj in targets:
        for op in ops:
            try:
                _json_patch_op(obj, op)
            except (KeyError, IndexError, ValueError, TypeError) as exc:
                raise RenderError(f"{folder}: patch {op} on {object_id(obj)}: {exc}") from None


def _matches(obj: dict[str, Any], target: dict[str, Any], folder: Path) -> bool:
    unknown = sorted(set(target) - {"group", "version", "kind", "name"})
    if unknown or "kind" not in target or "name" not in target:
        raise RenderError(f"{folder}: a patch target needs kind and name (and only group, "
                          f"version besides): {target}")  # fmt: skip
    group, _, version = obj["apiVersion"].rpartition("/")
    return (obj["kind"] == target["kind"] and object_id(obj)[2] == target["name"]
            and target.get("group", group) == group
            and target.get("version", version) == version)  # fmt: skip


def _json_patch_op(doc: Any, op: dict[str, Any]) -> None:
    """One RFC 6902 operation, in place (add, remove, replace, test)."""
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    if not parts:
        raise ValueError("the whole document cannot be patched")
    parent = doc
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last, kind = parts[-1], op["op"]
    if kind == "test":
        found = parent[int(last)] if isinstance(parent, list) else parent[last]
        if found != op["value"]:
            raise ValueError(f"test failed: found {found!r}")
    elif kind == "add" and isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if not 0 <= index <= len(parent):
            raise IndexError(f"index {index} out of range")
        parent.insert(index, copy.deepcopy(op["value"]))
    elif kind == "add":
        parent[last] = copy.deepcopy(op["value"])
    elif kind in ("remove", "replace"):
        key: Any = int(last) if isinstance(parent, list) else last
        if isinstance(parent, dict) and key not in parent:
            raise KeyError(f"{op['path']} does not exist")
        if kind == "remove":
            del parent[key]
        else:
            parent[key] = copy.deepcopy(op["value"])
    else:
        raise ValueError(f"operation {kind!r} is not supported")


def _set_namespace(objects: list[dict[str, Any]], namespace: str) -> None:
    for obj in objects:
        if obj["kind"] not in CLUSTER_SCOPED:
            obj.setdefault("metadata", {})["namespace"] = namespace
        if obj["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            for subject in obj.get("subjects") or []:
                if subject.get("kind") == "ServiceAccount":
                    subject["namespace"] = namespace
