"""A kubelet for the k8s tests: the pods of rendered manifests (deploy/k8s/tools/pods.py) run as
plain processes on this machine with exactly the command, arguments and environment their
containers get, and what a cluster would give them mapped onto it:

* network: each pod's ports become free loopback ports; a pod's own addresses (0.0.0.0,
  127.0.0.1) map to its ports, a headless Service's pod names (<pod>.<service>[.<namespace>])
  and a Service's name to the ports of the pods it selects (through its targetPort), so an
  address no Service or pod answers to fails the test;
* volumes: Secrets, ConfigMaps and emptyDirs become folders (items projected as the kubelet
  does), each mountPath in a value is that folder, each pod's /tmp its own;
* the API server: an HTTPS endpoint that stores the Secrets the keys Job creates (answering 409
  when one exists) and checks each against the Secret schema; pods that mount them start after.

Probes run as the kubelet runs them: exec (mapped like the container's own command), httpGet and
tcpSocket against the pod's ports.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional

from deploy.k8s.tools.pods import Pod, container_argv, container_env, expand, selects
from deploy.k8s.tools.validate import validate_all
from tests.e2e.stack_tools import free_port

ROOT = Path(__file__).resolve().parents[2]
ADDRESS = re.compile(r"(tcp|https?)://([\w.*-]+):(\d+)")
OWN_HOSTS = ("0.0.0.0", "*", "127.0.0.1", "localhost")
ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN = "k8s-test-token"
PROBE_TIMEOUT_S = 10.0


class ApiServer:
    """The namespace's Secrets over HTTPS (a self-signed certificate made with openssl)."""

    def __init__(self, tmp: Path, namespace: str) -> None:
        self.secrets: dict[str, dict[str, bytes]] = {}
        self.problems: list[str] = []
        self.cert = tmp / "api.crt"
        key = tmp / "api.key"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", str(key), "-out", str(self.cert)],
                       check=True, capture_output=True, timeout=60)  # fmt: skip
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler(namespace))
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(self.cert, key)
        self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _handler(self, namespace: str) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server hook's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                ok_path = self.path == f"/api/v1/namespaces/{namespace}/secrets"
                if self.headers.get("Authorization") != f"Bearer {TOKEN}" or not ok_path:
                    return self._answer(403)
                secret = json.loads(body)
                api.problems += validate_all([secret])
                name = secret["metadata"]["name"]
                if name in api.secrets:
                    return self._answer(409)
                api.secrets[name] = {k: base64.b64decode(v) for k, v in secret["data"].items()}
                self._answer(201)

            def _answer(self, code: int) -> None:
                self.send_response(code)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class LocalCluster:
    """The pods of `objects`; `replicas` overrides Deployments' counts, `swap` replaces a
    container's `python -m MODULE` by another module with extra environment (the simulated
    worker for the model's)."""

    def __init__(
        self,
        objects: list[dict[str, Any]],
        namespace: str,
        tmp: Path,
        replicas: dict[str, int],
        swap: dict[str, tuple[str, dict[str, str]]],
    ) -> None:
        self.objects, self.namespace, self.tmp = objects, namespace, tmp
        self.pods = expand(objects, namespace, replicas)
        self.api = ApiServer(tmp, namespace)
        self._swap = swap
        self._ports: dict[tuple[str, int], int] = {}
        self.procs: list[tuple[Pod, dict[str, Any], subprocess.Popen]] = []

    # ---- network -----------------------------------------------------------------------------

    def port(self, pod: Pod, port: int) -> int:
        return self._ports.setdefault((pod.name, port), free_port())

    def resolve(self, pod: Pod, host: str, port: int) -> int:
        """The loopback port that `host:port`, seen from `pod`, reaches."""
        if host in OWN_HOSTS:
            return self.port(pod, port)
        parts = host.split(".")
        for suffix in (["svc", "cluster", "local"], ["svc"], [self.namespace]):
            if parts[-len(suffix) :] == suffix and len(parts) > len(suffix):
                parts = parts[: -len(suffix)]
        if len(parts) == 2:  # <pod>.<headless service>
            found = [p for p in self.pods if p.name == parts[0] and p.subdomain == parts[1]]
            if found and self._service(parts[1], headless=True):
                return self.port(found[0], port)
        elif len(parts) == 1 and (service := self._service(parts[0], headless=False)):
            return self._through(service, port)
        raise LookupError(f"{pod.name}: nothing answers {host}:{port} in the cluster")

    def _service(self, name: str, headless: bool) -> Optional[dict[str, Any]]:
        for obj in self.objects:
            if obj["kind"] == "Service" and obj["metadata"]["name"] == name:
                return obj if (obj["spec"].get("clusterIP") == "None") == headless else None
        return None

    def _through(self, service: dict[str, Any], port: int) -> int:
        spec = service["spec"]
        entry = next(p for p in spec["ports"] if p["port"] == port)
        for pod in (p for p in self.pods if selects(spec["selector"], p.labels)):
            for container in pod.containers():
                for cport in container.get("ports") or []:
                    if entry.get("targetPort", port) in (cport["name"], cport["containerPort"]):
                        return self.port(pod, cport["containerPort"])
        raise LookupError(f"Service {service['metadata']['name']}: no pod has port {port}")

    # ---- processes ---------------------------------------------------------------------------

    def map_value(self, pod: Pod, container: dict[str, Any], text: str) -> str:
        """A value as the process on this machine must see it: addresses and paths mapped."""
        text = ADDRESS.sub(lambda m: f"{m.group(1)}://127.0.0.1:"
                           f"{self.resolve(pod, m.group(2), int(m.group(3)))}", text)  # fmt: skip
        mounts = {m["mountPath"]: self._volume_dir(pod, m["name"])
                  for m in container.get("volumeMounts") or []}  # fmt: skip
        mounts.setdefault("/tmp", self.tmp / pod.name / "tmp")
        if pod.spec.get("automountServiceAccountToken", True) is not False:
            mounts[ACCOUNT_DIR] = self._account_dir(pod)
        # one pass, so that a folder put in is not mapped again (it may lie under /tmp)
        inside = "|".join(re.escape(m) for m in sorted(mounts, key=len, reverse=True))
        pattern = rf"(?<![\w/.-])({inside})(?=/|$)"
        return re.sub(pattern, lambda m: str(mounts[m.group(1)]), text)

    def environment(self, pod: Pod, container: dict[str, Any]) -> dict[str, str]:
        env = container_env(pod, container, self.objects, self.api.secrets)
        out = {k: self.map_value(pod, container, v) for k, v in env.items()}
        if "CONVEYOR_HTTP_PORT" in out:  # a port of its own, not written as an address
            out["CONVEYOR_HTTP_HOST"] = "127.0.0.1"
            out["CONVEYOR_HTTP_PORT"] = str(self.port(pod, int(env["CONVEYOR_HTTP_PORT"])))
        out.pop("CONVEYOR_CACHE_DIR", None)  # the image bakes /models; here the host's cache
        if "CONVEYOR_CACHE_DIR" in os.environ:
            out["CONVEYOR_CACHE_DIR"] = os.environ["CONVEYOR_CACHE_DIR"]
        out.update(PATH=os.environ["PATH"], HOME=os.environ.get("HOME", "/root"),
                   PYTHONPATH=str(ROOT), KUBERNETES_SERVICE_HOST="127.0.0.1",
                   KUBERNETES_SERVICE_PORT=str(self.api.port))  # fmt: skip
        return out

    def argv(self, pod: Pod, container: dict[str, Any], env: dict[str, str]) -> list[str]:
        argv = container_argv(container, container_env(pod, container, self.objects,
                                                       self.api.secrets))  # fmt: skip
        if argv[:2] == ["python", "-m"] and argv[2] in self._swap:
            module, extra = self._swap[argv[2]]
            argv[2] = module
            env.update(extra)
        return [sys.executable if a == "python" else self.map_value(pod, container, a)
                for a in argv]  # fmt: skip

    def start(self, pod: Pod, container: dict[str, Any], serve: bool = True) -> subprocess.Popen:
        """Start one container's process; `serve`: a service (stopped by `stop`), not a step
        of a Job (waited for)."""
        self._materialize_volumes(pod)
        env = self.environment(pod, container)
        argv = self.argv(pod, container, env)
        log = open(self.tmp / f"{pod.name}.{container['name']}.log", "a")  # noqa: SIM115
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        if serve:
            self.procs.append((pod, container, proc))
        return proc

    def run_to_completion(self, pod: Pod, timeout: float) -> list[int]:
        """A Job's pod: its init containers in order, then its containers; their exit codes.
        Each run is a new pod (fresh emptyDirs), as a Job's retry or a re-created Job is."""
        shutil.rmtree(self.tmp / pod.name, ignore_errors=True)
        codes = []
        for container in pod.containers(init=True) + pod.containers():
            proc = self.start(pod, container, serve=False)
            try:
                codes.append(proc.wait(timeout))
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
        return codes

    def log(self, pod: Pod, container: dict[str, Any]) -> str:
        path = self.tmp / f"{pod.name}.{container['name']}.log"
        return path.read_text() if path.exists() else ""

    def stop(self, grace_s: float) -> None:
        """SIGTERM every process (frontends first, as pods go), then SIGKILL the late ones."""
        for _, _, proc in self.procs:
            proc.terminate()
        for _, _, proc in self.procs:
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.api.close()

    # ---- volumes -----------------------------------------------------------------------------

    def _volume_dir(self, pod: Pod, name: str) -> Path:
        return self.tmp / pod.name / "volumes" / name

    def _account_dir(self, pod: Pod) -> Path:
        folder = self.tmp / pod.name / "serviceaccount"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "token").write_text(TOKEN)
        (folder / "namespace").write_text(self.namespace)
        (folder / "ca.crt").write_bytes(self.api.cert.read_bytes())
        return folder

    def _materialize_volumes(self, pod: Pod) -> None:
        (self.tmp / pod.name / "tmp").mkdir(parents=True, exist_ok=True)
        for volume in pod.spec.get("volumes") or []:
            folder = self._volume_dir(pod, volume["name"])
            if folder.exists():
                continue  # written once per pod, shared by its containers
            folder.mkdir(parents=True)
            sources = (volume.get("projected") or {}).get("sources") or [volume]
            for source in sources:
                for path, data in self._files(source).items():
                    (folder / path).parent.mkdir(parents=True, exist_ok=True)
                    (folder / path).write_bytes(data)

    def _files(self, source: dict[str, Any]) -> dict[str, bytes]:
        if "secret" in source:
            ref = source["secret"]
            data = self.api.secrets[ref.get("secretName") or ref["name"]]
        elif "configMap" in source:
            ref = source["configMap"]
            cm = next(o for o in self.objects if o["kind"] == "ConfigMap"
                      and o["metadata"]["name"] == ref["name"])  # fmt: skip
            data = {k: v.encode() for k, v in cm["data"].items()}
        else:  # emptyDir
            return {}
        items = ref.get("items")
        return {i["path"]: data[i["key"]] for i in items} if items else dict(data)

    # ---- probes ------------------------------------------------------------------------------

    def probe(self, pod: Pod, container: dict[str, Any], kind: str) -> bool:
        """One `kind` probe (readinessProbe, ...) as the kubelet runs it: True on success."""
        spec = container[kind]
        if "exec" in spec:
            env = self.environment(pod, container)
            argv = [sys.executable if a == "python" else self.map_value(pod, container, a)
                    for a in spec["exec"]["command"]]  # fmt: skip
            done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True,
                                  timeout=PROBE_TIMEOUT_S)  # fmt: skip
            return done.returncode == 0
        target = spec.get("httpGet") or spec["tcpSocket"]
        local = self.port(pod, self._container_port(container, target["port"]))
        if "httpGet" in spec:
            url = f"http://127.0.0.1:{local}{target['path']}"
            try:
                with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as response:
                    return 200 <= response.status < 400
            except OSError:
                return False
        try:
            socket.create_connection(("127.0.0.1", local), timeout=PROBE_TIMEOUT_S).close()
            return True
        except OSError:
            return False

    @staticmethod
    def _container_port(container: dict[str, Any], port: Any) -> int:
        for entry in container.get("ports") or []:
            if port in (entry["name"], entry["containerPort"]):
                return int(entry["containerPort"])
        raise LookupError(f"{container['name']} has no port {port}")
