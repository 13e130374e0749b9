"""Fault soak (`make soak-faults`; docs/RELIABILITY.md §7): mixed bursts against one engine for
`--duration` seconds while a random service (worker, scheduler or frontend) is killed with
SIGKILL every ~`--kill-every` seconds.

    PYTHONPATH=. .venv/bin/python bench/soak_faults.py --duration 600 --out results/soak-faults

The engine is `conveyor up` as a child process (the REAL worker, SmolLM2-135M in float32, the
HTTP gateway, `--restart on-failure`: it restarts whatever dies). References first: every
prompt of a fixed pool run greedy with nothing killed, its top-2 logprobs kept. Then
back-to-back bursts of `--burst-size` requests at once: greedy streams from the pool (through
the Python client, which resumes its streams when the frontend dies, or through the gateway's
SSE), seeded sampled streams with `ignore_eos`, and one in eight aborted by its client after its
first chunk. Passes when:

* no request is lost: each ends once, with `done` (aborted ones with finish_reason abort);
* none is duplicated: each stream's token count is its `done`'s usage, sampled ones have
  exactly `max_tokens`; every greedy stream equals its reference token for token (but at a
  near-tie of the reference's two best logprobs, below 1e-4: tests/greedy_reference.py);
* every service's RSS after each burst past the warm-up stays within `--bound-mib` of its value
  after the warm-up (a restarted service starts low again);
* the engine ends with no request live and no KV block in use.

Writes <out>/soak-faults.json. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.soak import rss_mib
from shared.client import AsyncClient, Client, EngineError

ROOT = Path(__file__).resolve().parent.parent
SERVICES = {"worker": "services.worker", "scheduler": "services.scheduler",
            "tokenizer": "services.tokenizer", "gateway": "services.gateway"}  # fmt: skip
KILLABLE = ("worker", "scheduler", "tokenizer")
NEAR_TIE = 1e-4
KINDS = ("greedy", "greedy", "http", "sampled", "greedy", "sampled", "greedy", "abort")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of bursts")
    p.add_argument("--kill-every", type=float, default=60.0, help="mean seconds between kills")
    p.add_argument("--burst-size", type=int, default=24)
    p.add_argument("--num-prompts", type=int, default=32, help="the greedy pool")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--warmup-bursts", type=int, default=3)
    p.add_argument("--bound-mib", type=float, default=64.0)
    p.add_argument("--kv-cache-memory", default="96MiB")
    p.add_argument("--seed", type=int, default=34)
    p.add_argument("--out", type=Path, default=Path("results/soak-faults"))
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Engine:
    """`conveyor up` as a child; its services found by their command lines."""

    def __init__(self, args: argparse.Namespace, log_dir: Path) -> None:
        self.address = f"tcp://127.0.0.1:{_free_port()}"
        self.http_port = _free_port()
        argv = [sys.executable, "-m", "conveyor", "up", "--worker", "model", "--dtype", "float32",
                "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "2048",
                "--frontend-addr", self.address, "--http-port", str(self.http_port),
                "--log-dir", str(log_dir), "--quiet", "--requeue-timeout", "300"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)  # fmt: skip

    def pids(self) -> dict[str, int]:
        """Each service's current pid (children of `up`, by module)."""
        out: dict[str, int] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            for name, module in SERVICES.items():
                if ppid == self.proc.pid and f"-m {module} " in f"{cmd} ":
                    out[name] = int(entry.name)
        return out

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, "conveyor up exited"
            try:
                with Client(self.address, timeout=5.0, resume_timeout=0) as c:
                    if c.health()["ready"] and _http_ok(self.http_port):
                        return
            except EngineError:
                pass
            assert time.monotonic() < deadline, "the engine did not become ready"
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _http_ok(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def prompts(n: int) -> list[str]:
    words = ("belt", "parcel", "motor", "sorter", "crate", "roller", "scanner", "pallet")
    return [f"Note {i}: the {words[i % len(words)]} in hall {i // 8} is" for i in range(n)]


def references(engine: Engine, pool: list[str], max_tokens: int) -> list[dict[str, Any]]:
    """Each prompt's greedy tokens and, per position, its two best (token, logprob)."""
    out = []
    with Client(engine.address, timeout=600.0) as c:
        for p in pool:
            done = c.generate(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                              logprobs=2)  # fmt: skip
            top2 = [list(zip(e["top_token_ids"], e["top_logprobs"], strict=True))
                    for e in done.logprobs or []]  # fmt: skip
            out.append({"token_ids": done.token_ids, "text": done.text, "top2": top2})
    return out


def greedy_ok(got: list[int], ref: dict[str, Any]) -> bool:
    """Equal to the reference, or parted from it at a near-tie of its two best."""
    for i, (mine, want) in enumerate(zip(got, ref["token_ids"], strict=False)):
        if mine != want:
            (t1, l1), (t2, l2) = ref["top2"][i][:2]
            return l1 - l2 < NEAR_TIE and mine in (t1, t2)
    return len(got) == len(ref["token_ids"])


REFUSED = "refused"  # not admitted (the engine was restarting): sent again, not a loss
MAX_REFUSALS = 60


async def one_request(
    client: AsyncClient, http_port: int, job: dict[str, Any], refs: list[dict[str, Any]]
) -> str:
    """One request of a burst, sent again (after 1 s) while the engine refuses to admit it
    during a restart; its verdict: "ok", "aborted", or what went wrong."""
    for _ in range(MAX_REFUSALS):
        verdict = await _attempt(client, http_port, job, refs)
        if verdict != REFUSED:
            return verdict
        job["refusals"] = job.get("refusals", 0) + 1
        await asyncio.sleep(1.0)
    return "refused_too_often"


async def _attempt(
    client: AsyncClient, http_port: int, job: dict[str, Any], refs: list[dict[str, Any]]
) -> str:
    kind, params = job["kind"], job["params"]
    tokens: list[int] = []
    try:
        if kind == "http":
            return await _http_stream(http_port, job, refs)
        stream = client.stream(job["prompt"], **params)
        async for chunk in stream:
            tokens += chunk.token_ids
            if kind == "abort":
                await client.abort(stream.id)
        done = stream.done
        if done is None:
            return "no_done"
        if kind == "abort":
            return "aborted" if done.finish_reason in ("abort", "length") else done.finish_reason
        if done.usage.get("completion_tokens") != len(tokens):
            return "duplicated_or_lost_tokens"
        if kind == "greedy":
            return "ok" if greedy_ok(tokens, refs[job["ref"]]) else "greedy_mismatch"
        return "ok" if len(tokens) == params["max_tokens"] else "wrong_length"
    except EngineError as exc:
        never_admitted = exc.code == "not_ready" or "cannot connect" in exc.message
        return REFUSED if never_admitted and not tokens else f"error:{exc.code}"


async def _http_stream(port: int, job: dict[str, Any], refs: list[dict[str, Any]]) -> str:
    body = {"prompt": job["prompt"], "stream": True, **job["params"]}
    text = []
    async with httpx.AsyncClient(timeout=600.0) as http:
        async with http.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            if r.status_code == 503:
                return REFUSED  # not ready (a restart): nothing admitted
            if r.status_code != 200:
                return f"http_{r.status_code}"
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if "error" in event:
                        return f"error:{event['error'].get('code')}"
                    text.append(event["choices"][0]["text"])
    ref = refs[job["ref"]]
    return "ok" if "".join(text) == ref["text"] else "greedy_mismatch"


def burst_jobs(rng: random.Random, pool: list[str], args: argparse.Namespace) -> list[dict]:
    greedy = {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
    jobs = []
    for i in range(args.burst_size):
        ref = rng.randrange(len(pool))
        kind = ("greedy", "greedy", "http", "sampled", "greedy", "sampled", "greedy", "abort")[
            i % 8
        ]
        params = dict(greedy)
        if kind == "sampled":
            params = {"max_tokens": rng.randint(4, args.max_tokens), "temperature": 0.8,
                      "seed": rng.randrange(1 << 31), "ignore_eos": True}  # fmt: skip
        jobs.append({"kind": kind, "prompt": pool[ref], "ref": ref, "params": params})
    return jobs


async def run_burst(engine: Engine, jobs: list[dict], refs: list[dict]) -> list[str]:
    async with AsyncClient(engine.address, timeout=600.0, resume_timeout=120.0) as client:
        return list(await asyncio.gather(
            *(one_request(client, engine.http_port, job, refs) for job in jobs)))  # fmt: skip


class Killer(threading.Thread):
    """Kills a random killable service every ~`every` s (uniform in [0.5, 1.5] x every)."""

    def __init__(self, engine: Engine, every: float, rng: random.Random) -> None:
        super().__init__(daemon=True)
        self.engine, self.every, self.rng = engine, every, rng
        self.kills: list[tuple[float, str]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self._stop_event.wait(self.every * self.rng.uniform(0.5, 1.5)):
            name = self.rng.choice(KILLABLE)
            pid = self.engine.pids().get(name)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                self.kills.append((round(time.monotonic() - t0, 1), name))
                print(f"killed {name} (pid {pid})", flush=True)

    def stop(self) -> None:
        self._stop_event.set()


def rss_growth(after: list[dict[str, float]], warmup: int, bound: float) -> dict[str, Any]:
    """Per service: RSS after the warm-up and the largest after it; growth within `bound`."""
    out = {}
    for name in SERVICES:
        series = [a[name] for a in after if name in a]
        if len(series) <= warmup:
            continue
        base, peak = series[warmup], max(series[warmup:])
        out[name] = {"after_warmup_mib": round(base, 1), "peak_after_warmup_mib": round(peak, 1),
                     "end_mib": round(series[-1], 1), "growth_mib": round(peak - base, 1),
                     "within_bound": peak - base <= bound}  # fmt: skip
    return out


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="conveyor-soak-faults-"))
    engine = Engine(args, log_dir)
    try:
        engine.wait_ready(900)
        pool = prompts(args.num_prompts)
        refs = references(engine, pool, args.max_tokens)
        killer = Killer(engine, args.kill_every, random.Random(args.seed + 1))
        killer.start()
        outcomes: dict[str, int] = {}
        refused = 0  # admissions refused during a restart (sent again)
        after: list[dict[str, float]] = []
        started = time.monotonic()
        while time.monotonic() - started < args.duration:
            jobs = burst_jobs(rng, pool, args)
            verdicts = asyncio.run(run_burst(engine, jobs, refs))
            for v in verdicts:
                outcomes[v] = outcomes.get(v, 0) + 1
            refused += sum(job.get("refusals", 0) for job in jobs)
            after.append({n: rss_mib(p) for n, p in engine.pids().items()})
            print(
                f"burst {len(after)} at {time.monotonic() - started:.0f} s: {verdicts.count('ok')}"
                f" ok, {sorted(set(verdicts) - {'ok', 'aborted'})}",
                flush=True,
            )
        killer.stop()
        engine.wait_ready(300)
        with Client(engine.address, timeout=60.0) as c:
            final = c.stats()["engine"] or {}
    finally:
        engine.stop()
    bad = {k: v for k, v in outcomes.items() if k not in ("ok", "aborted")}
    report = {
        "duration_s": round(time.monotonic() - started, 1), "num_bursts": len(after),
        "num_requests": sum(outcomes.values()), "outcomes": outcomes, "kills": killer.kills,
        "admissions_refused_and_sent_again": refused,
        "rss": rss_growth(after, args.warmup_bursts, args.bound_mib),
        "end": {k: final.get(k) for k in ("kv_blocks_used", "num_live_requests")},
        "log_dir": str(log_dir), "args": {k: str(v) for k, v in vars(args).items()},
    }  # fmt: skip
    (args.out / "soak-faults.json").write_text(json.dumps(report, indent=2))
    shown = ("num_requests", "outcomes", "admissions_refused_and_sent_again", "kills", "rss", "end")
    print(json.dumps({k: report[k] for k in shown}, indent=2))
    rss_ok = all(s["within_bound"] for s in report["rss"].values())
    idle = report["end"] == {"kv_blocks_used": 0, "num_live_requests": 0}
    return 0 if not bad and rss_ok and idle and killer.kills else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
