"""The conveyor-keys Job's second step: the key folder made by `conveyor keys generate` and a
fresh HTTP API key become the Secrets conveyor-curve and conveyor-api-key.

    python publish_keys.py KEYS_DIR --service-account /var/run/secrets/kubernetes.io/serviceaccount

A Secret that exists is kept as it is (the API server answers 409): re-running the Job never
replaces keys that clients already hold (`conveyor keys generate --keep-existing` in compose).
conveyor-curve holds the folder's top-level files under their own names (server.key,
server.key_secret, client.key, ...); the authorized_*/ folders hold copies of the public keys,
so each pod's keys volume projects them from the same entries (deploy/k8s: `items`).

Runs in the Conveyor image with the Python standard library alone; talks to the API server as
the pod's service account (its token, CA and namespace files), at KUBERNETES_SERVICE_HOST and
KUBERNETES_SERVICE_PORT, which the kubelet sets in every container.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

LABELS = {"app.kubernetes.io/name": "conveyor", "app.kubernetes.io/component": "keys"}
KEY_SUFFIXES = (".key", ".key_secret")
API_KEY_FIELD = "api-key"
TIMEOUT_S = 30.0


def curve_data(keys_dir: Path) -> dict[str, bytes]:
    """The folder's top-level key files, by name; each authorized_*/NAME.key must be a copy of
    the top-level NAME.key (the pods project them from it). Raises ValueError otherwise."""
    data = {p.name: p.read_bytes() for p in sorted(keys_dir.iterdir())
            if p.is_file() and p.name.endswith(KEY_SUFFIXES)}  # fmt: skip
    if "server.key_secret" not in data:
        raise ValueError(f"{keys_dir} holds no server.key_secret: not a `conveyor keys` folder")
    for allowed in sorted(keys_dir.glob("authorized_*/*.key")):
        if data.get(allowed.name) != allowed.read_bytes():
            raise ValueError(f"{allowed} is not a copy of {keys_dir / allowed.name}")
    return data


def secret_manifest(name: str, data: dict[str, bytes]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": LABELS},
        "type": "Opaque",
        "data": {key: base64.b64encode(value).decode("ascii") for key, value in data.items()},
    }


class ApiServer:
    """The namespace's Secrets endpoint, reached as the pod's service account."""

    def __init__(self, account_dir: Path, base_url: Optional[str] = None) -> None:
        self._account = account_dir
        self._base = base_url or _in_cluster_url()
        namespace = (account_dir / "namespace").read_text().strip()
        self._secrets_url = f"{self._base}/api/v1/namespaces/{namespace}/secrets"
        self._tls = ssl.create_default_context(cafile=str(account_dir / "ca.crt"))

    def create_secret(self, manifest: dict) -> bool:
        """True when created, False when a Secret of that name exists (kept as it is)."""
        token = (self._account / "token").read_text().strip()  # re-read: tokens rotate
        request = urllib.request.Request(
            self._secrets_url,
            data=json.dumps(manifest).encode(),
            method="POST",
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=self._tls):
                return True
        except urllib.error.HTTPError as exc:
            if exc.code == 409:
                return False
            detail = exc.read().decode("utf-8", "replace")[:500]
            name = manifest["metadata"]["name"]
            raise RuntimeError(f"creating {name}: {exc.code} {detail}") from None


def _in_cluster_url() -> str:
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("keys_dir", type=Path, help="the folder `conveyor keys generate` made")
    parser.add_argument(
        "--service-account", type=Path, required=True, help="its token, ca.crt and namespace"
    )
    parser.add_argument("--curve-secret", default="conveyor-curve")
    parser.add_argument("--api-key-secret", default="conveyor-api-key")
    args = parser.parse_args(argv)
    try:
        api = ApiServer(args.service_account)
        wanted = [
            (args.curve_secret, curve_data(args.keys_dir)),
            (args.api_key_secret, {API_KEY_FIELD: secrets.token_urlsafe(32).encode()}),
        ]
        for name, data in wanted:
            created = api.create_secret(secret_manifest(name, data))
            print(f"secret/{name} {'created' if created else 'exists: kept as it is'}")
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"publish_keys: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
