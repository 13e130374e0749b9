"""deploy/k8s as plain processes, as tests/e2e/test_compose.py does for compose: for each
overlay, the keys Job runs with exactly its commands, twice (the second keeps the Secrets),
against a local API server that checks each Secret against its schema; then every container of
every pod runs with exactly the command, arguments and environment the manifests give it
(tests/e2e/k8s_cluster.py maps Service and pod DNS names to loopback ports and volumes to
folders). Two changes, both named here: the model's worker is the simulated one
(`python -m services.worker.sim`, the same process flags, no model load: this checks the
wiring, not the model), and one frontend and one gateway run of the two each Deployment asks.

Every startup, readiness and liveness probe passes; a request with the client keys taken from
the conveyor-curve Secret is served through the `frontend` Service and `health` shows every
engine ready (data parallelism: both DNS names reached; tensor parallelism: the scheduler
admits only once all 3 ranks joined); a request without keys is refused; the gateway serves
/v1/completions with the key from conveyor-api-key and refuses one without. Runtime:
~14 s per overlay, ~30 s for the file (e2e-stacks group), on the shared 2-core machine.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import pytest

from deploy.k8s.tools.check import OVERLAYS_DIR
from deploy.k8s.tools.pods import Pod
from deploy.k8s.tools.render import render
from shared.client import Client, EngineError
from tests.bounds import SLOW_HOST_MARGIN_S
from tests.e2e.k8s_cluster import LocalCluster

pytestmark = [pytest.mark.e2e, pytest.mark.model]  # the frontends load SmolLM2's tokenizer

NAMESPACE = "conveyor"
# The two engine kinds. cpu and gpu make data-parallel's pods with one engine (and gpu, worker
# settings that the simulated worker ignores; the real worker's parser checks them, and the
# engine list of each overlay, in tests/unit/test_k8s_manifests.py): ~15 s each saved.
OVERLAYS = ("data-parallel", "tensor-parallel")
SIM_ENV = {"CONVEYOR_SIM_MODEL": "smollm2-135m", "CONVEYOR_SIM_DEVICE": "cpu-smollm2"}
SIMULATED = {"services.worker": ("services.worker.sim", SIM_ENV)}
ONE_EACH = {"frontend": 1, "gateway": 1}
READY_TIMEOUT_S = 60.0 + SLOW_HOST_MARGIN_S  # processes start in seconds; probes poll
JOB_TIMEOUT_S = 60.0


@pytest.fixture(params=OVERLAYS)
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalCluster]:
    objects = render(OVERLAYS_DIR / request.param)
    local = LocalCluster(objects, NAMESPACE, tmp_path, replicas=ONE_EACH, swap=SIMULATED)
    try:
        yield local
    finally:
        local.stop(grace_s=30.0)


def _job(cluster: LocalCluster) -> Pod:
    return next(p for p in cluster.pods if p.workload == "Job/conveyor-keys")


def _run_keys_job(cluster: LocalCluster) -> None:
    job = _job(cluster)
    first: Optional[dict[str, Any]] = None
    for _ in range(2):  # the second run is a re-applied Job: it keeps the Secrets
        codes = cluster.run_to_completion(job, JOB_TIMEOUT_S)
        logs = "".join(cluster.log(job, c) for c in job.containers(True) + job.containers())
        assert codes == [0, 0], logs
        first = first or {k: dict(v) for k, v in cluster.api.secrets.items()}
    assert "secret/conveyor-curve exists: kept as it is" in logs
    assert cluster.api.secrets == first
    assert set(first) == {"conveyor-curve", "conveyor-api-key"}
    assert cluster.api.problems == []  # each Secret valid against the Kubernetes schema


def _start_pods(cluster: LocalCluster) -> list[tuple[Pod, dict[str, Any]]]:
    started = []
    for pod in cluster.pods:
        if pod is not _job(cluster):
            for container in pod.containers():
                cluster.start(pod, container)
                started.append((pod, container))
    return started


def _wait_until_probes_pass(cluster: LocalCluster, started: list) -> None:
    """Startup then readiness probes of every container, then one liveness round."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    pending = list(started)
    while pending:
        for pod, container, proc in cluster.procs:
            assert proc.poll() is None, f"{pod.name}/{container['name']} exited:\n" + (
                cluster.log(pod, container)[-3000:])  # fmt: skip
        with ThreadPoolExecutor(len(pending)) as pool:  # as the kubelet: each on its own clock
            passed = list(pool.map(lambda pc: _up_and_ready(cluster, *pc), pending))
        pending = [pc for pc, ok in zip(pending, passed, strict=True) if not ok]
        names = [f"{p.name}/{c['name']}" for p, c in pending]
        assert time.monotonic() < deadline, f"not ready after {READY_TIMEOUT_S:.0f} s: {names}"
        time.sleep(0.5 if pending else 0)
    for pod, container in started:
        assert cluster.probe(pod, container, "livenessProbe"), f"{pod.name}/{container['name']}"


def _up_and_ready(cluster: LocalCluster, pod: Pod, container: dict[str, Any]) -> bool:
    return cluster.probe(pod, container, "startupProbe") and cluster.probe(
        pod, container, "readinessProbe"
    )


def _client_keys(cluster: LocalCluster, folder: Path) -> dict[str, Path]:
    """What an operator copies out of the conveyor-curve Secret for a client (docs/deploy.md)."""
    folder.mkdir()
    curve = cluster.api.secrets["conveyor-curve"]
    (folder / "server.key").write_bytes(curve["server.key"])
    (folder / "client.key_secret").write_bytes(curve["client.key_secret"])
    return {"server_key": folder / "server.key", "client_key": folder / "client.key_secret"}


def _post(url: str, body: dict, api_key: Optional[str]) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_k8s_pods_run_as_plain_processes(cluster: LocalCluster, tmp_path: Path) -> None:
    _run_keys_job(cluster)
    _wait_until_probes_pass(cluster, _start_pods(cluster))
    num_engines = sum(1 for _, c, _ in cluster.procs if c["name"] == "scheduler")
    frontend = f"tcp://127.0.0.1:{cluster.resolve(_job(cluster), 'frontend', 5557)}"
    with Client(frontend, timeout=60, **_client_keys(cluster, tmp_path / "client")) as client:
        done = client.generate("The capital of France is", max_tokens=4, temperature=0.0)
        engines = client.health()["engines"]
    assert done.usage["completion_tokens"] == 4 and done.text
    assert len(engines) == num_engines and all(e["ready"] for e in engines), engines
    with pytest.raises(EngineError) as refused, Client(frontend, timeout=2, connect_timeout=2) as c:
        c.generate("The capital of France is", max_tokens=1)  # no keys: CURVE refuses it
    assert refused.value.code == "engine_unreachable"
    url = f"http://127.0.0.1:{cluster.resolve(_job(cluster), 'gateway', 8000)}/v1/completions"
    api_key = cluster.api.secrets["conveyor-api-key"]["api-key"].decode()
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 3}
    status, reply = _post(url, body, api_key)
    assert status == 200 and reply["usage"]["completion_tokens"] == 3, reply
    assert _post(url, body, None)[0] == 401
