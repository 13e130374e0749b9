"""Tensor parallelism over torch.distributed (gloo on CPU), with real worker processes (issue 16).

* A tiny random model (8 query heads, 4 KV heads, untied LM head, q/k/v biases, a vocabulary of
  265 that no world size divides) at world size 2 and 4 against its unsharded self in this
  process: logits of every sampled row within 1e-5, the same greedy tokens, every rank holding
  the sampled tokens, and each rank's reported weight and per-block KV bytes about 1/N.
* Speculative decoding (issue 30; rank 0 proposes and verifies, services/worker/spec_ranks.py):
  greedy requests through the real scheduler with draft limits, `--speculative ngram` at world
  size 2 and a one-layer draft model (rank 0 only) at 4: the same text as the unsharded model
  without speculation (a regex-constrained row among them: its output valid), drafts proposed,
  some accepted and some rejected, and after every step every rank holding the same histories
  and computed counts.
* Start-up refuses a world size that does not divide SmolLM2-135M's heads (9 and 3), naming them.
* `--worker sim --tensor-parallel-size 8` stays one process that models 8 H200s.
Rough runtime: 15-35 s (six worker processes importing torch at once on 2 cores).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conveyor.launcher import LocalStack
from services.worker.runner import ModelRunner
from services.worker.sim.config import SimConfig
from shared.client import Client
from tests.e2e.stack_tools import ROOT, engine_settings, free_port
from tests.support.tiny_model import write_tiny_model
from tests.support.tp_rank import run_work, worker_config
from tests.support.tp_scheduled import REGEX, REGEX_RID, decoded

pytestmark = pytest.mark.e2e

WORLD_SIZES = (2, 4)
SPECULATIVE = {2: "ngram", 4: "draft"}  # the draft model: `shallow`
RANK_TIMEOUT_S = 240.0  # start-up of 6 processes on a shared 2-core host; normally ~15 s
LOGITS_TOL = 1e-5
EOS_IDS = (2,)  # the tiny model's


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("tiny-tp"),
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        attention_bias=True,
    )


@pytest.fixture(scope="module")
def shallow(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft for `tiny`: its embedding, LM head and first layer of two (the same seed), so it
    agrees with the target often, not always."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-tp-draft"), num_attention_heads=8,
                            num_key_value_heads=4, tie_word_embeddings=False,
                            attention_bias=True, num_hidden_layers=1)  # fmt: skip


def _rank_argv(model: Path, draft: Path, rank: int, world: int, port: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "tests.support.tp_rank", "--model", str(model),
            "--rank", str(rank), "--world-size", str(world),
            "--dist-init", f"tcp://127.0.0.1:{port}", "--out", str(out),
            "--speculative", SPECULATIVE[world], "--draft-model", str(draft)]  # fmt: skip


@pytest.fixture(scope="module")
def sharded(
    tiny: Path, shallow: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, list[dict]]:
    """world size -> every rank's record; both groups run at once (one start-up wait)."""
    procs: dict[int, list[subprocess.Popen]] = {}
    outs: dict[int, Path] = {}
    for world in WORLD_SIZES:
        outs[world] = tmp_path_factory.mktemp(f"tp{world}")
        port = free_port()
        procs[world] = [
            subprocess.Popen(_rank_argv(tiny, shallow, r, world, port, outs[world]), cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(world)
        ]  # fmt: skip
    try:
        for world, group in procs.items():
            for rank, proc in enumerate(group):
                out, _ = proc.communicate(timeout=RANK_TIMEOUT_S)
                assert proc.returncode == 0, f"world {world} rank {rank} failed:\n{out[-3000:]}"
    finally:
        for group in procs.values():
            for proc in group:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    return {
        world: [torch.load(outs[world] / f"rank{r}.pt") for r in range(world)]
        for world in WORLD_SIZES
    }


@pytest.fixture(scope="module")
def reference(tiny: Path) -> dict:
    """The unsharded model, run in this process (world size 1, no process group)."""
    return run_work(ModelRunner(worker_config(str(tiny), "torch")))


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_sharded_logits_match_unsharded(world: int, sharded: dict, reference: dict) -> None:
    first = sharded[world][0]
    assert len(first["logits"]) == len(reference["logits"]) > 5
    for got, want in zip(first["logits"], reference["logits"], strict=True):
        assert got.shape == want.shape and want.shape[-1] == 265
        assert (got - want).abs().max().item() < LOGITS_TOL
    for other in sharded[world][1:]:
        assert other["logits"] == []  # only rank 0 gathers the logits


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_every_rank_holds_the_sampled_tokens(world: int, sharded: dict, reference: dict) -> None:
    want = reference["greedy"]
    assert all(len(toks) == 6 for toks in want.values())
    for record in sharded[world]:
        assert record["greedy"] == want
        assert record["histories"] == reference["histories"]
        for rid, history in record["histories"].items():  # the rank decoded its outputs
            assert history[-len(want[rid]) :] == want[rid]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_each_rank_holds_its_share(world: int, sharded: dict, reference: dict) -> None:
    full = reference["ready"]
    full_per_block = full["kv_cache_bytes"] / full["num_blocks"]
    for rank, record in enumerate(sharded[world]):
        ready = record["ready"]
        assert ready["rank"] == rank and ready["world_size"] == world
        # per-block KV bytes exactly 1/N (KV heads split); the same budget holds N x the blocks
        assert ready["kv_cache_bytes"] / ready["num_blocks"] == full_per_block / world
        assert ready["num_blocks"] == world * full["num_blocks"]
        # weights: everything but the norms (replicated) and the vocab padding is split
        share = ready["weight_bytes"] / full["weight_bytes"]
        assert 1 / world <= share < 1 / world + 0.05, (rank, share)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_speculation_keeps_the_text_and_every_rank_in_step(
    world: int, sharded: dict, reference: dict, tiny: Path
) -> None:
    want = reference["scheduled"]
    assert want["proposed"] == 0  # the reference: no speculation
    first = sharded[world][0]["scheduled"]
    assert first["outputs"] == want["outputs"]
    plain = {rid: toks for rid, toks in want["outputs"].items() if rid != REGEX_RID}
    regex_out = want["outputs"][REGEX_RID]
    assert all(len(toks) == 24 for toks in plain.values())
    # the constrained row: the grammar completed its text and ended it
    assert regex_out[-1] in EOS_IDS and re.fullmatch(REGEX, decoded(tiny, regex_out[:-1]))
    assert first["proposed"] > first["accepted"] > 0, (first["proposed"], first["accepted"])
    proposed, accepted = first["regex_drafts"]  # the constrained row drafted too
    assert proposed > accepted, (proposed, accepted)
    if SPECULATIVE[world] == "ngram":  # the prompt holds its n-grams (the draft model: random)
        assert accepted > 0, (proposed, accepted)
    for other in sharded[world][1:]:  # the same KV state (counts, histories) after every step
        assert other["scheduled"]["states"] == first["states"]


def test_refuses_a_world_size_that_does_not_split_smollm2(tmp_path: Path) -> None:
    """N=2 on SmolLM2-135M: every rank refuses before joining any group (exit 2)."""
    proc = subprocess.run(
        [sys.executable, "-m", "services.worker", "--model", "smollm2", "--rank", "0",
         "--world-size", "2", "--dist-init", f"tcp://127.0.0.1:{free_port()}",
         "--worker-addr", f"ipc://{tmp_path}/w.sock", "--log-format", "json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    text = proc.stdout + proc.stderr
    assert "tensor-parallel size 2 does not divide" in text
    assert "9 query heads" in text and "3 KV heads" in text and "use one of 1, 3" in text


def test_sim_worker_models_the_group_in_one_process(tmp_path: Path) -> None:
    settings = engine_settings(tmp_path / "logs", gateway=False, worker="sim",
                               sim_config=SimConfig(device="h200", model="llama-3-70b"),
                               tensor_parallel_size=8)  # fmt: skip
    with LocalStack(settings) as stack:
        assert sorted(stack.services) == ["scheduler", "tokenizer", "worker"]
        with Client(stack.frontend_address, timeout=60.0) as client:
            assert len(client.generate("hi", max_tokens=4, temperature=0.0).token_ids) == 4
        log = (stack.log_dir / "worker.log").read_text()
    assert '"device":"h200x8"' in log
