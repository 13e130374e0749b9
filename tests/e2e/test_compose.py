"""docker-compose.yml: valid for docker-compose 1.29.2 (the Python program Debian ships; no
Docker engine needed; `make test` installs it into .tools/compose), and coherent: the
`keys` service's command, then the tokenizer, scheduler and worker started as plain processes
with exactly the commands and environment the compose file gives them (container addresses
mapped to 127.0.0.1 on free ports, container paths to temporary ones) serve a request with the
generated client keys, refuse one without, and the compose healthchecks (with each service's
environment, as in its container) pass against them. Exposure: the scheduler and worker are only
on the internal network, every published port is on 127.0.0.1, CURVE and the gateway's API key
are on. Rough runtime: 20-60 s (an fp32 model load).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from shared.client import Client, EngineError
from tests.e2e.stack_tools import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[2]
ENGINE_SERVICES = ("scheduler", "worker", "tokenizer")
CURVE_SERVICES = ("scheduler", "worker", "tokenizer")  # CONVEYOR_CURVE_KEYS set
CURVE_CLIENTS = ("tokenizer", "gateway")  # SERVER_KEY / CLIENT_KEY (healthcheck, gateway)
ADDRESS = re.compile(r"tcp://[\w.*-]+:(\d+)")


COMPOSE = ROOT / ".tools" / "compose" / "bin" / "docker-compose"  # installed by `make test`


def _compose_config(files: list[Path]) -> subprocess.CompletedProcess:
    assert COMPOSE.exists(), f"{COMPOSE} is missing: `make test` installs it (Makefile)"
    argv = [str(COMPOSE)] + [a for f in files for a in ("-f", str(f))] + ["config", "-q"]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("files", [["docker-compose.yml"],
                                   ["docker-compose.yml", "docker-compose.gpu.yml"]])  # fmt: skip
def test_compose_config_is_valid(files: list[str]) -> None:
    done = _compose_config([ROOT / f for f in files])
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda spec: spec["services"]["worker"].update(depends_on=["nowhere"]), "nowhere"),
        (lambda spec: spec["services"]["tokenizer"].update(ports="5557"), "ports"),
        (lambda spec: spec["services"]["scheduler"].update(unknown_key=1), "unknown_key"),
        (lambda spec: spec["services"]["worker"].update(env_file=["compose/missing.env"]),
         "missing.env"),
    ],
    ids=["undefined-dependency", "ports-not-a-list", "unknown-key", "missing-env-file"],
)  # fmt: skip
def test_compose_validation_catches_a_broken_file(tmp_path: Path, change, message: str) -> None:
    """The validator is real: the same file with one mistake fails, naming the mistake."""
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    change(spec)
    broken = ROOT / f".broken-compose-{tmp_path.name}.yml"  # beside the file: same relative paths
    try:
        broken.write_text(yaml.safe_dump(spec))
        done = _compose_config([broken])
    finally:
        broken.unlink()
    assert done.returncode != 0 and message in done.stderr, done.stderr


def _read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    return env


def _service_env(spec: dict) -> dict[str, str]:
    files = spec.get("env_file", [])
    env: dict[str, str] = {}
    for name in [files] if isinstance(files, str) else files:
        env.update(_read_env_file(ROOT / name))
    env.update({k: str(v) for k, v in (spec.get("environment") or {}).items()})
    return env


class _Mapper:
    """Container world -> this machine: one free local port per compose port."""

    def __init__(self, tmp: Path) -> None:
        self.ports: dict[str, int] = {}
        self.paths = {"/tmp/": f"{tmp}/", "/keys": f"{tmp}/keys"}

    def port(self, port: str) -> int:
        return self.ports.setdefault(port, free_port())

    def value(self, text: str) -> str:
        text = ADDRESS.sub(lambda m: f"tcp://127.0.0.1:{self.port(m.group(1))}", text)
        for inside, outside in self.paths.items():
            text = text.replace(inside, outside)
        return text

    def argv(self, argv: list[str]) -> list[str]:
        return [sys.executable if a == "python" else self.value(a) for a in argv]


@pytest.fixture
def compose_stack(tmp_path: Path) -> Iterator[tuple[dict, _Mapper]]:
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    mapper = _Mapper(tmp_path)
    procs = []
    for _ in range(2):  # the second run keeps the keys of the first (a restarted stack)
        keys = subprocess.run(mapper.argv(spec["keys"]["command"]), cwd=ROOT, timeout=60,
                              capture_output=True, text=True)  # fmt: skip
        assert keys.returncode == 0, keys.stderr
    try:
        for name in ENGINE_SERVICES:
            env = {k: mapper.value(v) for k, v in _service_env(spec[name]).items()}
            # The image bakes the converted model into /models; here the host's cache holds it.
            env.pop("CONVEYOR_CACHE_DIR")
            if name == "worker":
                # worker.env pins bfloat16, ~5x slower than fp32 on AVX2-only CPUs: this test
                # checks the wiring, not the dtype, so it names the cheap one everywhere.
                env["CONVEYOR_DTYPE"] = "float32"
            env.update(PATH=os.environ["PATH"], HOME=os.environ.get("HOME", "/root"),
                       PYTHONPATH=str(ROOT))  # fmt: skip
            if "CONVEYOR_CACHE_DIR" in os.environ:
                env["CONVEYOR_CACHE_DIR"] = os.environ["CONVEYOR_CACHE_DIR"]
            log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
            argv = mapper.argv(spec[name]["command"])
            proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            procs.append((proc, log))
        yield spec, mapper
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, log in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


def _healthy(spec: dict, mapper: _Mapper, name: str) -> bool:
    """The healthcheck as its container runs it: with the service's environment."""
    argv = spec[name]["healthcheck"]["test"]
    assert argv[0] == "CMD"
    env = {k: mapper.value(v) for k, v in _service_env(spec[name]).items()}
    done = subprocess.run(mapper.argv(argv[1:]), cwd=ROOT, capture_output=True, timeout=30,
                          env={**os.environ, **env, "PYTHONPATH": str(ROOT)})  # fmt: skip
    return done.returncode == 0


def test_compose_exposes_nothing_unauthenticated() -> None:
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services, networks = spec["services"], spec["networks"]
    internal = {name for name, net in networks.items() if (net or {}).get("internal")}
    assert internal, "no internal network"
    for name in ("scheduler", "worker"):
        assert set(services[name]["networks"]) <= internal, name  # never published, no route out
        assert "ports" not in services[name], name
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)
    envs = {name: _service_env(services[name]) for name in (*CURVE_SERVICES, "gateway")}
    for name in CURVE_SERVICES:
        assert envs[name].get("CONVEYOR_CURVE_KEYS") == "/keys", name
    for name in CURVE_CLIENTS:
        assert envs[name].get("CONVEYOR_SERVER_KEY") == "/keys/server.key", name
        assert envs[name].get("CONVEYOR_CLIENT_KEY") == "/keys/client.key_secret", name
    assert envs["gateway"].get("CONVEYOR_API_KEY"), "the gateway has no API key"


def test_compose_services_run_as_plain_processes(compose_stack: tuple[dict, _Mapper]) -> None:
    spec, mapper = compose_stack
    deadline = time.monotonic() + 600
    while not all(_healthy(spec, mapper, name) for name in ENGINE_SERVICES):
        assert time.monotonic() < deadline, "the compose services never became healthy"
        time.sleep(1.0)
    published = spec["tokenizer"]["ports"][0].split(":")[-1]
    address = f"tcp://127.0.0.1:{mapper.port(published)}"
    keys = {"server_key": Path(mapper.value("/keys/server.key")),
            "client_key": Path(mapper.value("/keys/client.key_secret"))}  # fmt: skip
    with Client(address, timeout=300, **keys) as client:
        done = client.generate("The capital of France is", max_tokens=4, temperature=0.0)
    assert done.usage["completion_tokens"] == 4 and done.text.strip()
    with pytest.raises(EngineError) as refused, Client(address, timeout=3, connect_timeout=3) as c:
        c.generate("The capital of France is", max_tokens=1)  # no keys: CURVE refuses it
    assert refused.value.code == "engine_unreachable"
