"""LocalStack: the embedded default. Starts tokenizer, scheduler and worker (and the HTTP
gateway) as child processes, internal sockets as ipc:// in a private run directory, the
frontend on tcp://127.0.0.1:5557 unless told otherwise.

    with LocalStack(StackSettings(...)) as stack:     # start() + wait_ready()
        Client(stack.frontend_address).generate(...)
                                                       # stop(): drains, then no process left
`conveyor up` is a thin CLI over this class; the e2e tests use it directly.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import msgpack
import zmq

from conveyor.procs import ServiceProcess, stop_in_order
from conveyor.stack_settings import WORKER_KINDS, StackSettings
from services.tokenizer.config import new_frontend_id
from services.worker.config import ParallelConfig
from services.worker.process_config import WorkerProcessConfig
from shared.config_flags import config_argv
from shared.curve import client_secret_path, make_curve_client, server_public_path

__all__ = ["WORKER_KINDS", "LocalStack", "StackError", "StackSettings", "probe_health"]

ROOT = Path(__file__).resolve().parent.parent
STEP_MARK = '"event":"step"'  # the scheduler's per-step lines: many per second when busy


class StackError(RuntimeError):
    """A service failed to start or died; the message names it and shows its last lines."""


def worker_rank_name(base: str, rank: int) -> str:
    """Service (and log file) name of a worker rank of the engine whose rank-0 worker is
    `base` ("worker", or "worker-<engine>" with several engines): `base` for rank 0 (as
    without tensor parallelism), "<base>-<rank>" for the others."""
    return base if rank == 0 else f"{base}-{rank}"


def is_worker_rank(name: str) -> bool:
    return name == "worker" or name.startswith("worker-")


def gateway_available() -> bool:
    return importlib.util.find_spec("services.gateway.__main__") is not None


class LocalStack:
    """The services of one frontend and its engine(s) on this machine. Not thread-safe; one
    owner."""

    def __init__(self, settings: StackSettings) -> None:
        self.settings = settings
        self.services: dict[str, ServiceProcess] = {}
        self._engine_of: dict[str, Optional[int]] = {}  # service name -> its engine, if any
        self._worker_addrs: dict[int, str] = {}  # engine -> its worker socket, set by start()
        self.run_dir: Optional[Path] = None
        self.frontend_address = settings.frontend_address
        self.log_dir = settings.log_dir.resolve()
        self.with_gateway = settings.gateway and gateway_available()
        http = settings.gateway_config
        self.http_url = f"http://{http.http_host}:{http.http_port}" if self.with_gateway else None
        keys = settings.curve_keys
        # (server public key file, client key pair file) for clients of this stack, or Nones
        self.client_keys: tuple[Optional[Path], Optional[Path]] = (
            (server_public_path(keys), client_secret_path(keys)) if keys else (None, None)
        )

    # ---- start -------------------------------------------------------------------------------

    def start(self) -> LocalStack:
        """Spawn every service (returns at once; `wait_ready` waits for the handshake)."""
        if self.services:
            raise StackError("already started")
        self.run_dir = Path(tempfile.mkdtemp(prefix="conveyor-"))
        s = self.settings
        sched_addrs = [self._start_engine(i) for i in range(s.num_engines)]
        frontend = dataclasses.replace(
            s.frontend_config, frontend_address=self.frontend_address,
            scheduler_addresses=tuple(sched_addrs), frontend_id=new_frontend_id(),
            model=s.model, drain_timeout_s=s.drain_timeout_s, curve_keys=s.curve_keys,
        )  # fmt: skip
        self._spawn("tokenizer", "services.tokenizer", [frontend])
        if self.with_gateway:
            server_key, client_key = self.client_keys
            gateway = dataclasses.replace(
                s.gateway_config, engine_addr=self.frontend_address,
                max_frame_bytes=frontend.max_frame_bytes, server_key=server_key,
                client_key=client_key,
            )  # fmt: skip
            self._spawn("gateway", "services.gateway", [gateway])
        elif s.gateway:
            self._note("gateway: services.gateway is not installed; HTTP API not started")
        return self

    def engine_names(self, index: int) -> tuple[str, str]:
        """The service names (and log file stems) of engine `index`: its scheduler and its
        rank-0 worker (rank r > 0 is "<worker>-<r>")."""
        if self.settings.num_engines == 1:
            return "scheduler", "worker"
        return f"scheduler-{index}", f"worker-{index}"

    def _start_engine(self, index: int) -> str:
        """Spawn engine `index` (a scheduler and its worker ranks); returns the scheduler
        address."""
        if self.run_dir is None:
            raise StackError("start() makes the run folder first")
        s = self.settings
        scheduler, worker = self.engine_names(index)  # also the socket file names
        sched_addr = f"ipc://{self.run_dir}/{scheduler}.sock"
        self._worker_addrs[index] = f"ipc://{self.run_dir}/{worker}.sock"
        server = dataclasses.replace(
            s.server_config, frontend_address=sched_addr, worker_address=self._worker_addrs[index],
            num_workers=1 if s.worker == "sim" else s.tensor_parallel_size,
            drain_timeout_s=s.drain_timeout_s, curve_keys=s.curve_keys, role=s.role_of(index),
        )  # fmt: skip
        self._spawn(scheduler, "services.scheduler", [s.scheduler_config, server], engine=index)
        self._spawn_workers(index)
        return sched_addr

    def _spawn_workers(self, engine: int) -> None:
        """Every worker rank of engine `engine`; a tensor-parallel group meets at a fresh
        loopback port (each (re)start gets its own, so a restarted group never meets a dying
        one's store)."""
        s = self.settings
        base = self.engine_names(engine)[1]
        # a prefill engine's worker serves its leased KV to the decode workers
        kv_addr = None
        if s.role_of(engine) == "prefill":
            ipc = f"ipc://{self.run_dir}/{base}-kv.sock"
            kv_addr = ipc if s.kv_transport == "ipc" else "tcp://127.0.0.1:0"  # any free port
        link = WorkerProcessConfig(
            worker_addr=self._worker_addrs[engine], curve_keys=s.curve_keys, kv_addr=kv_addr
        )
        if s.worker == "sim":
            self._spawn(base, "services.worker.sim", [s.sim(), link], engine=engine)
            return
        world = s.tensor_parallel_size
        meet = f"tcp://127.0.0.1:{_free_port()}" if world > 1 else None
        config = dataclasses.replace(s.worker_config, model=s.model)
        for rank in range(world):
            group = ParallelConfig(rank, world, meet) if meet else ParallelConfig()
            self._spawn(worker_rank_name(base, rank), "services.worker", [config, group, link],
                        engine=engine)  # fmt: skip

    def _spawn(
        self, name: str, module: str, configs: list[Any], engine: Optional[int] = None
    ) -> None:
        """Start `python -m module` as service `name` with the flags that rebuild `configs`
        there (shared/config_flags.py) and every service's log settings; `engine`: the engine
        whose service it is (CONVEYOR_ENGINE)."""
        env = self._env(name, engine)
        # Log files are written by the launcher from the services' stdout, as JSON lines; the
        # echo renders them for a console.
        logs = dataclasses.replace(self.settings.logs, log_file=None, log_format="json")
        argv = [sys.executable, "-m", module]
        for config in (*configs, logs):
            argv += config_argv(config, env)
        hide = () if self.settings.show_steps else (STEP_MARK,)
        self._engine_of[name] = engine
        self.services[name] = ServiceProcess(
            name, argv, env, self.log_dir, self.settings.echo, cwd=ROOT, hide=hide
        )
        self._note(f"started {name} (pid {self.services[name].pid})")

    def _env(self, name: str, engine: Optional[int] = None) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        env["TOKENIZERS_PARALLELISM"] = "false"
        if not is_worker_rank(name):  # only workers compute: the others leave them the cores
            env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        env.pop("CONVEYOR_ENGINE", None)
        if engine is not None:
            env["CONVEYOR_ENGINE"] = str(engine)  # the `engine` field of its log lines
            if self.settings.num_engines > 1 and is_worker_rank(name):
                env.update(self._engine_devices(engine, env))
        env.update(self.settings.env)
        return env

    def _engine_devices(self, engine: int, env: dict[str, str]) -> dict[str, str]:
        """What engine `engine`'s worker may use when several engines share this host: the
        engine-th visible GPU (ignored on CPU), and on CPU its share of the cores as torch
        threads (unless OMP_NUM_THREADS is set): M workers with all the cores each would
        oversubscribe them (docs/PERFORMANCE.md §11)."""
        devices = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        out = {"CUDA_VISIBLE_DEVICES": devices[engine] if engine < len(devices) else str(engine)}
        if "OMP_NUM_THREADS" not in os.environ:
            cores = len(os.sched_getaffinity(0))
            out["OMP_NUM_THREADS"] = str(max(1, cores // self.settings.num_engines))
        return out

    def _note(self, text: str) -> None:
        if self.settings.echo is not None:
            self.settings.echo.write(f"{'conveyor':>9} | {text}\n")
            self.settings.echo.flush()

    # ---- readiness and liveness --------------------------------------------------------------

    def is_ready(self) -> bool:
        """One look (about a second): the frontend says every engine is ready (worker
        handshakes done) and the gateway, if any, listens. Raises StackError when a service has
        exited."""
        self._raise_if_dead()
        reply = health_reply(self.frontend_address, 1.0, *self.client_keys)
        if reply is None or reply.get("ready") is not True:
            return False
        if not all(e.get("ready") is True for e in reply.get("engines") or []):
            return False
        http = self.settings.gateway_config
        return self.http_url is None or _port_open(http.http_host, http.http_port)

    def wait_ready(self, timeout: float = 300.0, stop: Optional[threading.Event] = None) -> bool:
        """Block until ready; False when `stop` was set first. Raises StackError when a
        service exits first or the timeout passes."""
        deadline = time.monotonic() + timeout
        while not self.is_ready():
            if stop is not None and stop.is_set():
                return False
            if time.monotonic() > deadline:
                raise StackError(f"engine not ready after {timeout:.0f} s")
            time.sleep(0.2)
        self._note(f"ready: frontend {self.frontend_address}"
                   + (f", HTTP {self.http_url}" if self.http_url else ""))  # fmt: skip
        return True

    def dead_service(self) -> Optional[tuple[str, int]]:
        """(name, exit code) of the first service that has exited, or None."""
        for name, svc in self.services.items():
            rc = svc.returncode()
            if rc is not None:
                return name, rc
        return None

    def _raise_if_dead(self) -> None:
        dead = self.dead_service()
        if dead is not None:
            name, rc = dead
            svc = self.services[name]
            svc.join_output(1.0)
            raise StackError(f"{name} exited with code {rc}; last lines:\n{svc.last_lines()}")

    def restart(self, name: str) -> None:
        """Start a service that exited again, with the same command line (its log goes on in
        the same file). Called by `conveyor up`'s supervisor (conveyor/up.py)."""
        old = self.services[name]
        if old.returncode() is None:
            raise StackError(f"{name} is still running")
        old.join_output(1.0)
        hide = () if self.settings.show_steps else (STEP_MARK,)
        env = self._env(name, self._engine_of.get(name))
        self.services[name] = ServiceProcess(
            name, old.argv, env, self.log_dir, self.settings.echo, cwd=ROOT, hide=hide
        )
        self._note(f"restarted {name} (pid {self.services[name].pid})")

    def restart_workers(self, engine: int) -> None:
        """Stop every worker rank of engine `engine` still running, then start its whole group
        again (a tensor-parallel rank cannot rejoin a group whose other members live on; the
        other engines keep serving). Called by `conveyor up`'s supervisor when any rank of
        that engine exits with an error."""
        ranks = [
            svc
            for name, svc in self.services.items()
            if is_worker_rank(name) and self._engine_of.get(name) == engine
        ]
        stop_in_order([ranks], timeout_s=self.settings.drain_timeout_s + 5.0)
        for svc in ranks:
            svc.join_output(1.0)
            del self.services[svc.name]
        self._spawn_workers(engine)
        self._note(f"restarted the worker group of {self.engine_names(engine)[0]}")

    def engine_of(self, name: str) -> Optional[int]:
        """The engine whose service `name` is (None for the frontends)."""
        return self._engine_of.get(name)

    def pids(self) -> dict[str, int]:
        return {name: svc.pid for name, svc in self.services.items()}

    # ---- stop --------------------------------------------------------------------------------

    def stop(self) -> None:
        """Drain and stop: frontends and scheduler first, then the worker; nothing survives."""
        svcs = self.services
        groups = [
            [svcs[n] for n in ("gateway", "tokenizer") if n in svcs],
            [svc for n, svc in svcs.items() if n.startswith("scheduler")],
            [svc for n, svc in svcs.items() if is_worker_rank(n)],
        ]
        stop_in_order(groups, timeout_s=self.settings.drain_timeout_s + 5.0)
        self._note("stopped")
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> LocalStack:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def probe_health(
    address: str,
    timeout: float = 1.0,
    server_key: Optional[Path] = None,
    client_key: Optional[Path] = None,
) -> bool:
    """Ask the frontend `health` (docs/protocol.md) over a fresh DEALER: True when ready.
    `server_key` / `client_key`: CURVE key files for a frontend started with --curve-keys."""
    reply = health_reply(address, timeout, server_key, client_key)
    return reply is not None and reply.get("ready") is True


def health_reply(
    address: str,
    timeout: float = 1.0,
    server_key: Optional[Path] = None,
    client_key: Optional[Path] = None,
) -> Optional[dict[str, Any]]:
    """The frontend's `health` reply (docs/protocol.md), or None without one in `timeout`."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if server_key is not None and client_key is not None:
            make_curve_client(sock, server_key, client_key)
        sock.connect(address)
        sock.send(msgpack.packb({"type": "health", "v": 1, "id": "launcher"}))
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1):
                return None
            reply = msgpack.unpackb(sock.recv(), raw=False)
            if isinstance(reply, dict) and reply.get("type") == "health":
                return reply
        return None
    finally:
        sock.close()


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the tensor-parallel ranks' meeting point)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False
