"""CPU time of each process of a serving stack over one benchmark, per output token.

bench/peer_llama_server.sh takes a snapshot of the server's process tree (`conveyor up` and its
services, or llama-server) before and after the benchmark command, then prints, per process,
its CPU time (user + system, every thread) in milliseconds per output token:

    python bench/peer_cpu.py snapshot --pid PID --out before.json
    python bench/peer_cpu.py report before.json after.json --result result.json --extra-tokens N

`--extra-tokens`: tokens the benchmark generated beyond the result's `total_output_tokens` (its
warm-up request). On one stream every process's CPU time is taken from the cores the worker's
threads compute on, so this is where the time outside the step goes.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _name(pid: int) -> str:
    """`worker`, `scheduler`, ... for `python -m services.<name>`; else the program's name."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    program = Path(argv[0].decode()).name
    if not program.startswith("python"):
        return program
    for flag, module in zip(argv, argv[1:], strict=False):
        if flag == b"-m":
            name = module.decode().rsplit(".", 1)[-1]
            return "up" if name == "conveyor" else name
    return program


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime (stat 14, 15)


def _tree(pid: int) -> list[int]:
    """`pid` and every descendant (from each process's parent in /proc/<pid>/stat)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:  # exited meanwhile
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def snapshot(pid: int, cpu_of: Callable[[int], float] = _cpu_s) -> dict[str, float]:
    """CPU so far (`cpu_of` a process: seconds by default) of each process in the tree (names
    made unique with #pid)."""
    out: dict[str, float] = {}
    for p in _tree(pid):
        try:
            name, cpu = _name(p), cpu_of(p)
        except OSError:  # exited meanwhile
            continue
        out[name if name not in out else f"{name}#{p}"] = cpu
    return out


def report(before: dict[str, float], after: dict[str, float], num_tokens: int) -> str:
    lines = [f"CPU ms per output token ({num_tokens} tokens):"]
    total = 0.0
    for name in sorted(after, key=lambda n: -(after[n] - before.get(n, 0.0))):
        ms = (after[name] - before.get(name, 0.0)) * 1000 / num_tokens
        total += ms
        lines.append(f"  {name:<14} {ms:7.2f}")
    lines.append(f"  {'all':<14} {total:7.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    snap = sub.add_parser("snapshot")
    snap.add_argument("--pid", type=int, required=True)
    snap.add_argument("--out", type=Path, required=True)
    rep = sub.add_parser("report")
    rep.add_argument("before", type=Path)
    rep.add_argument("after", type=Path)
    rep.add_argument("--result", type=Path, required=True, help="conveyor bench's result.json")
    rep.add_argument("--extra-tokens", type=int, default=0)
    args = parser.parse_args()
    if args.action == "snapshot":
        args.out.write_text(json.dumps(snapshot(args.pid)))
        return
    result = json.loads(args.result.read_text())
    num_tokens = int(result["total_output_tokens"]) + args.extra_tokens
    before, after = (json.loads(p.read_text()) for p in (args.before, args.after))
    print(report(before, after, num_tokens))


if __name__ == "__main__":
    main()
