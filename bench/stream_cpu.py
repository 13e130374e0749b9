"""CPU time per output token of each process of `conveyor up`, one stream, two checkouts A/B.

    PYTHONPATH=. flock -x /tmp/conveyor-cpu.lock .venv/bin/python bench/stream_cpu.py \
        --roots /work/main,. --rounds 6 --num-requests 8

Starts one `conveyor up` (its defaults: the default GGUF, the real worker; `--up-args` adds
flags) from each checkout in `--roots`, both at once and idle between turns, then alternates:
each round sends `--num-requests` streamed /v1/completions requests (32-token prompt, 128
tokens, EOS ignored, greedy), one after the other, to each stack in turn. Around each turn it
reads every thread's CPU time of the stack's processes (/proc/<pid>/task/*/schedstat: ns,
not the 10 ms ticks of /proc/<pid>/stat) and prints, per process, the median over rounds of
CPU µs per output token, with the stack's decode tok/s (1 / the median inter-chunk time), and
for each later checkout the median over rounds of its figure over the first's in that round.
A process's CPU per token does not depend much on how fast the machine runs that minute,
so it compares two checkouts more robustly than tok/s does (docs/lab/2026-12-single-stream.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench import peer_cpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_ns(pid: int) -> float:
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError):  # the thread exited meanwhile
            continue
    return total


def snapshot(pid: int) -> dict[str, float]:
    """CPU ns so far of each process of the tree rooted at `pid`, by service name."""
    return peer_cpu.snapshot(pid, _cpu_ns)


class Stack:
    def __init__(self, root: Path, up_args: list[str], log_dir: Path) -> None:
        self.root = root
        self.port = _free_port()
        py = root / ".venv" / "bin" / "python"
        argv = [str(py), "-m", "conveyor", "up", "--http-port", str(self.port),
                "--frontend-addr", f"tcp://127.0.0.1:{_free_port()}",
                "--log-dir", str(log_dir), "--quiet", *up_args]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(root), TOKENIZERS_PARALLELISM="false")
        self.out = open(log_dir.with_suffix(".out"), "w")  # noqa: SIM115
        self.proc = subprocess.Popen(argv, cwd=root, env=env, stdout=self.out,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=120,
                                   trust_env=False)  # fmt: skip

    def wait_ready(self, limit_s: float = 600) -> None:
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.root}: conveyor up exited")
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.root}: not ready")

    def stream(self, prompt: str, max_tokens: int) -> tuple[int, list[float]]:
        """One streamed request: (chunks with text, gaps between chunks in s)."""
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        times: list[float] = []
        with self.client.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"text"' in line:
                    times.append(time.perf_counter())
        return len(times), [b - a for a, b in zip(times, times[1:], strict=False)]

    def stop(self) -> None:
        self.client.close()
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.out.close()


def turn(stack: Stack, num_requests: int, prompt: str, max_tokens: int) -> dict[str, float]:
    before = snapshot(stack.proc.pid)
    num_tokens, gaps = 0, []
    for _ in range(num_requests):
        n, g = stack.stream(prompt, max_tokens)
        num_tokens += n
        gaps += g
    after = snapshot(stack.proc.pid)
    out = {name: (after[name] - before.get(name, 0)) / 1e3 / num_tokens for name in after}
    out["all"] = sum(out.values())
    out["tok_s"] = 1 / statistics.median(gaps)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--roots", default="/work/main,.", help="checkouts, comma-separated")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--up-args", default="", help="extra `conveyor up` flags")
    p.add_argument("--out", type=Path, default=None, help="JSON of every turn")
    args = p.parse_args()
    roots = [Path(r).resolve() for r in args.roots.split(",")]
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 3)  # ~32 tokens
    tmp = Path(tempfile.mkdtemp(prefix="stream_cpu-"))
    stacks = [Stack(r, args.up_args.split(), tmp / f"s{i}") for i, r in enumerate(roots)]
    turns: list[list[dict[str, float]]] = [[] for _ in roots]
    try:
        for s in stacks:
            s.wait_ready()
            s.stream(prompt, args.max_tokens)  # warm-up
        for rnd in range(args.rounds):
            order = range(len(stacks)) if rnd % 2 == 0 else reversed(range(len(stacks)))
            for i in order:
                turns[i].append(turn(stacks[i], args.num_requests, prompt, args.max_tokens))
            print(f"round {rnd}: " + "  ".join(
                f"{r.name}: all {t[-1]['all']:.0f} us {t[-1]['tok_s']:.1f} tok/s"
                for r, t in zip(roots, turns, strict=True)), flush=True)  # fmt: skip
    finally:
        for s in stacks:
            s.stop()
    names = sorted({n for t in turns for d in t for n in d}, key=lambda n: n != "tok_s")
    utc = time.strftime("%H:%M", time.gmtime())
    print(f"median over {args.rounds} rounds, CPU us per output token (ended {utc} UTC)")
    print(f"{'':12}" + "".join(f"{str(r)[-18:]:>20}" for r in roots))
    for n in names:
        vals = [statistics.median(d.get(n, 0.0) for d in t) for t in turns]
        # each later checkout over the first, round by round (the same minute): the median
        ratios = [statistics.median(b.get(n, 0.0) / a[n] for a, b in zip(turns[0], t, strict=True)
                                    if a.get(n)) for t in turns[1:]]  # fmt: skip
        print(f"{n:12}" + "".join(f"{v:20.1f}" for v in vals)
              + "".join(f"{r:10.3f}x" for r in ratios))  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps({str(r): t for r, t in zip(roots, turns, strict=True)}))


if __name__ == "__main__":
    main()
