"""`python -m deploy.k8s.tools.check [OVERLAY ...]`: render each overlay of deploy/k8s (all by
default) and validate every object offline (render.py, validate.py); exit 1 naming each
problem. `--print OVERLAY` writes one overlay's rendered YAML instead (what `kubectl
kustomize` would print). `--against-kubectl` also renders each overlay with `kubectl
kustomize`, where kubectl is installed, and reports every object that differs from ours (run it
after changing the manifests or the renderer).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Optional

import yaml

from deploy.k8s.tools.render import RenderError, dump, object_id, render
from deploy.k8s.tools.validate import kubernetes_versions, validate_all

K8S_DIR = Path(__file__).resolve().parents[1]
OVERLAYS_DIR = K8S_DIR / "overlays"


def overlays() -> list[str]:
    """Every overlay's name (a folder of deploy/k8s/overlays)."""
    return sorted(p.name for p in OVERLAYS_DIR.iterdir() if p.is_dir())


def check(name: str) -> list[str]:
    """The problems of one overlay: a render error, or each invalid field."""
    try:
        objects = render(OVERLAYS_DIR / name)
    except RenderError as exc:
        return [f"cannot render: {exc}"]
    return validate_all(objects)


def kubectl_differences(name: str) -> list[str]:
    """The objects of one overlay that `kubectl kustomize` renders otherwise than render.py."""
    argv = ["kubectl", "kustomize", str(OVERLAYS_DIR / name)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120).stdout
    theirs = {object_id(o): o for o in yaml.safe_load_all(out) if o}
    ours = {object_id(o): o for o in render(OVERLAYS_DIR / name)}
    keys = sorted(set(ours) | set(theirs))
    return [f"{'/'.join(k)}: differs from kubectl kustomize" for k in keys
            if ours.get(k) != theirs.get(k)]  # fmt: skip


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.k8s.tools.check",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("overlays", nargs="*", help="names in deploy/k8s/overlays (default: all)")
    parser.add_argument("--print", dest="show", choices=overlays(), help="print its YAML")
    parser.add_argument("--against-kubectl", action="store_true",
                        help="also compare with `kubectl kustomize`")  # fmt: skip
    args = parser.parse_args(argv)
    if args.show:
        sys.stdout.write(dump(render(OVERLAYS_DIR / args.show)))
        return 0
    versions = " and ".join(kubernetes_versions())
    failed = False
    for name in args.overlays or overlays():
        problems = check(name) + (kubectl_differences(name) if args.against_kubectl else [])
        failed |= bool(problems)
        print(f"{name}: " + ("valid" if not problems else f"{len(problems)} problem(s)")
              + f" (Kubernetes {versions} schemas, vendored CRDs)")  # fmt: skip
        for problem in problems:
            print(f"  {problem}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
