"""Restarts under ``torchrun --max-restarts`` (issue 38): a job whose rank is killed, mid-step and then mid-save,
is relaunched by torchrun's static rendezvous, resumes from its last checkpoint and ends bit-equal to an
uninterrupted run; a rendezvous that cannot complete is an ``InitError`` naming the fix, never a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import safetensors.torch
from dist_harness import _free_port, run_distributed
from job_restart import train

HERE = Path(__file__).resolve().parent
STEPS, KILL_STEP = 4, 2


def _torchrun_restarting(out: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]))
    # No --standalone: torchrun's default static rendezvous, whose agent store outlives each attempt.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=2",
           "--master-addr=127.0.0.1", f"--master-port={_free_port()}", str(HERE / "job_restart.py"), str(out),
           str(STEPS), str(KILL_STEP)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


def test_a_killed_rank_is_relaunched_and_resumes_bit_equal_to_an_uninterrupted_run(tmp_path: Path) -> None:
    expected = run_distributed(train, 2, str(tmp_path / "straight"), STEPS, -1)[0]
    done = _torchrun_restarting(tmp_path / "killed")
    assert done.returncode == 0, f"the restarted job failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    logs = {int(f.stem.split("-")[1]): json.loads(f.read_text()) for f in (tmp_path / "killed").glob("losses-*")}
    # Attempt 0 died in step 2 and attempt 1 in the save after it, so attempt 2 redid steps 2 and 3.
    assert sorted(logs) == [0, 2], logs
    assert [int(s) for s in logs[0]] == list(range(KILL_STEP)) and [int(s) for s in logs[2]] == [2, 3]
    losses = {int(s): v for log in logs.values() for s, v in log.items()}
    assert losses == expected, "losses after two restarts equal the uninterrupted run's, bit for bit"
    got = safetensors.torch.load_file(tmp_path / "killed" / "final.safetensors")
    want = safetensors.torch.load_file(tmp_path / "straight" / "final.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].equal(want[name]), name
    leftovers = sorted(f.name for f in (tmp_path / "killed" / "ckpt").iterdir())
    assert len(leftovers) == 5 and len({f.split(".")[1] for f in leftovers if f != "metadata.json"}) == 1, \
        f"only the last save's files remain: {leftovers}"


_TRY_INIT = """
import datetime, os, bmt_wrap as bmt
for rank, agent in (("1", "True"), ("0", "")):  # torchrun's agent store is gone; rank 0's peer never comes
    os.environ.update(RANK=rank, TORCHELASTIC_USE_AGENT_STORE=agent)
    try:
        bmt.init_distributed(timeout=datetime.timedelta(seconds=2))
    except bmt.errors.InitError as e:
        print(e)
"""


def test_a_rendezvous_that_cannot_complete_is_an_init_error_naming_the_fix() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _TRY_INIT], capture_output=True, text=True, timeout=120, env=env)
    no_agent, no_peer = (done.stdout.splitlines() + ["", ""])[:2]
    assert "rank 1: connecting to the job's store at 127.0.0.1" in no_agent, done.stderr[-3000:]
    assert "hosted by torchrun's agent" in no_agent and "init_distributed(timeout=)" in no_agent
    assert "rank 0 of 2: joining the process group under 'bmt_wrap/'" in no_peer, no_peer
    assert "not every rank of this attempt joined within 2 s" in no_peer
    assert time.monotonic() - start < 60, "each step gave up after its timeout"
