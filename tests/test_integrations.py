"""transformers' Trainer, accelerate and Lightning on 2 gloo ranks, each against the same tool without
bmt_wrap (plain DDP), run under torchrun as users run them (tests/job_*.py): losses and logged gradient
norms equal DDP's, final weights within docs/design.md's AdamW tolerance, saving collective-safe,
resuming exact. The three jobs run in one torchrun job (job_tools.py), each tool's examples (examples/) after
its comparisons (tests/in_job.py), so the start-up is paid once. accelerate_loop.py's exact resume runs in a
job of its own, as a user resumes: in the process that saved, the RNG state a missing restore would leave is
already the saved one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from parity import ADAMW_REL, LOSS_RTOL, SGD_TOL

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"
SAVE_AT = 3
TINY_LM = ["--layers", "2", "--dim", "64", "--seq", "64"]  # the examples' byte-level Llama, shrunk
ACCELERATE_EXAMPLE = ["accelerate_loop.py", *TINY_LM, "--steps", "30"]
LIGHTNING_EXAMPLE = ["lightning_module.py", *TINY_LM, "--save-every", "10"]


def _torchrun(script: Path, *args: str) -> str:
    """Run ``script`` on 2 ranks under torchrun; its output, failing the test with it on a non-zero exit."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]),
               TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, f"{script.name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def tools(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One torchrun job (job_tools.py) running job_trainer.py, job_accelerate.py and job_lightning.py, each
    with its tool's examples after it, into OUT/trainer, OUT/accelerate and OUT/lightning."""
    out = tmp_path_factory.mktemp("tools")
    trainer, accelerate, lightning = out / "trainer", out / "accelerate", out / "lightning"
    examples = {
        # 30 steps, a checkpoint at 20
        "trainer": [["trainer_finetune.py", *TINY_LM, "--steps", "30", "--save-every", "20",
                     "--out-dir", str(trainer / "example")]],
        # 30 steps; and stopped after step 20 with its state saved
        "accelerate": [[*ACCELERATE_EXAMPLE, "--out-dir", str(accelerate / "full")],
                       [*ACCELERATE_EXAMPLE, "--stop-at", "20", "--out-dir", str(accelerate / "split")]],
        # 20 steps (checkpoints every 10); then to step 30 from its last checkpoint, a fresh Trainer and module
        "lightning": [[*LIGHTNING_EXAMPLE, "--steps", "20", "--out-dir", str(lightning / "a")],
                      [*LIGHTNING_EXAMPLE, "--steps", "30", "--resume", str(lightning / "a" / "ckpt" / "last.ckpt"),
                       "--out-dir", str(lightning / "b")]],
    }
    _torchrun(HERE / "job_tools.py", str(out), json.dumps(examples))
    return out


def _job(tools: Path, tool: str) -> tuple[Path, dict]:
    """A tool job's output folder and the results its rank 0 wrote."""
    return tools / tool, torch.load(tools / tool / "results.pt", weights_only=False)


def _close_to_ddp(got: dict[str, torch.Tensor], ddp: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == ddp.keys(), what
    for k, ref in ddp.items():
        rel = float((got[k].float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))
        assert rel <= ADAMW_REL, f"{what}: {k} is {rel:.2e} (relative) from DDP's, above {ADAMW_REL}"


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def _losses(log: list[dict]) -> list[float]:
    return [e["loss"] for e in log if "loss" in e]


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


# ---- transformers Trainer ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer_job(tools: Path) -> tuple[Path, dict]:
    return _job(tools, "trainer")


def test_transformers_trainer_matches_ddp_saves_and_resumes_exactly(trainer_job: tuple[Path, dict]) -> None:
    _, r = trainer_job
    ddp, ours, resumed = r["ddp"], r["bmt"], r["resumed"]
    assert _losses(ours["log"]) == pytest.approx(_losses(ddp["log"]), rel=LOSS_RTOL)
    norms = [e["grad_norm"] for e in ours["log"] if "grad_norm" in e]
    ddp_norms = [e["grad_norm"] for e in ddp["log"] if "grad_norm" in e]
    assert len(norms) == 5 and norms == pytest.approx(ddp_norms, rel=1e-5), "logged grad_norm is DDP's (all ranks)"
    assert ddp_norms[0] > 1.0, "the first step clips (max_grad_norm=1.0), so clipping is exercised"
    _close_to_ddp(ours["weights"], ddp["weights"], "Trainer")
    _equal(r["from_pretrained"], ours["weights"], "save_model + from_pretrained")
    _equal(resumed["weights"], ours["weights"], "resume_from_checkpoint")
    assert _losses(resumed["log"]) == _losses(ours["log"])
    assert "optimizer_sharded" in r["files"] and "optimizer.pt" not in r["files"], r["files"]


def test_trainer_finetune_example_learns_and_plain_transformers_reloads_it(trainer_job: tuple[Path, dict]) -> None:
    example = trainer_job[0] / "example"
    metrics = _metrics(example)
    assert metrics["losses"][-1] <= 0.8 * metrics["losses"][0], metrics["losses"]
    assert metrics["reloaded_eval_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-5)
    assert (example / "checkpoint-20" / "optimizer_sharded" / ".metadata").is_file()


# ---- accelerate ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def accelerate_job(tools: Path) -> tuple[Path, dict]:
    return _job(tools, "accelerate")


def test_accelerate_loop_matches_ddp_and_resumes_exactly(accelerate_job: tuple[Path, dict]) -> None:
    out, r = accelerate_job
    ddp, ours, resumed = r["ddp"], r["bmt"], r["resumed"]
    assert ours["losses"] == pytest.approx(ddp["losses"], rel=LOSS_RTOL)
    assert ours["norms"] == pytest.approx(ddp["norms"], rel=1e-5) and ddp["norms"][0] > 1.0
    _close_to_ddp(ours["weights"], ddp["weights"], "accelerate")
    _equal(resumed["weights"], ours["weights"], "save_state + load_state")
    assert resumed["losses"] == ours["losses"][SAVE_AT:]
    placeholder = torch.load(out / "state" / "optimizer.bin", weights_only=True)
    assert placeholder == {"bmt_wrap.sharded_optimizer_state": "optimizer_sharded"}
    assert len(list((out / "state" / "optimizer_sharded").glob("*.distcp"))) == 2
    assert "bmt_wrap.integrations.accelerate.Accelerator" in r["stock"], r["stock"]


def test_accelerate_accumulate_reduces_only_on_sync_steps_and_matches_ddp(accelerate_job: tuple[Path, dict]) -> None:
    ddp, ours = accelerate_job[1]["accumulate"]["ddp"], accelerate_job[1]["accumulate"]["bmt"]
    assert ours["synced"] == [False, False, False, True] * 2, ours["synced"]
    for synced, (calls, nbytes) in zip(ours["synced"], ours["reduce_scatters"], strict=True):
        assert (calls > 0 and nbytes > 0) if synced else (calls, nbytes) == (0, 0), ours["reduce_scatters"]
    assert ours["losses"] == pytest.approx(ddp["losses"], rel=LOSS_RTOL)
    assert ours["weights"].keys() == ddp["weights"].keys()
    for k, want in ddp["weights"].items():  # SGD: docs/design.md's elementwise tolerance
        torch.testing.assert_close(ours["weights"][k], want, **SGD_TOL, msg=lambda m, k=k: f"{k}: {m}")


def test_accelerate_loop_example_learns_and_resumes_exactly(accelerate_job: tuple[Path, dict]) -> None:
    out = accelerate_job[0]
    assert not _metrics(out / "split")["finished"], "--stop-at 20 ended the run early"
    log = _torchrun(EXAMPLES / "accelerate_loop.py", *ACCELERATE_EXAMPLE[1:], "--resume", "--out-dir", str(out / "split"))
    assert "resumed from step 20" in log
    full, split = _metrics(out / "full")["losses"], _metrics(out / "split")["losses"]
    assert split == full, "stop at 20 + load_state gives the uninterrupted run's losses, bit for bit"
    assert sum(full[-5:]) <= 0.8 * sum(full[:5]), full
    assert (out / "full" / "final" / "model.safetensors").is_file()


# ---- Lightning -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lightning_job(tools: Path) -> tuple[Path, dict]:
    return _job(tools, "lightning")


def test_lightning_matches_ddp_and_resumes_as_ddp_does(lightning_job: tuple[Path, dict]) -> None:
    # Lightning's own resume from an epoch-end checkpoint replays the next epoch in another order (DDP's
    # resumed run differs from its uninterrupted one too), so "exact" here is: as DDP resumes.
    out, r = lightning_job
    assert r["bmt"]["losses"] == pytest.approx(r["ddp"]["losses"], rel=LOSS_RTOL)
    _close_to_ddp(r["bmt"]["weights"], r["ddp"]["weights"], "Lightning")
    assert r["resumed"]["losses"] == pytest.approx(r["ddp_resumed"]["losses"], rel=LOSS_RTOL)
    assert r["resumed"]["losses"][0] == r["bmt"]["losses"][SAVE_AT], "the resumed weights are the saved ones"
    _close_to_ddp(r["resumed"]["weights"], r["ddp_resumed"]["weights"], "Lightning resumed")
    ckpt = out / "ckpt" / f"epoch=0-step={SAVE_AT}.ckpt"
    assert (ckpt / "meta.pt").is_file() and len(list(ckpt.glob("*.distcp"))) == 2


def test_lightning_module_example_learns_and_resumes_from_its_checkpoint(lightning_job: tuple[Path, dict]) -> None:
    out = lightning_job[0]
    first = _metrics(out / "a")
    assert first["global_step"] == 20 and sum(first["losses"][-5:]) <= 0.8 * sum(first["losses"][:5]), first
    ckpt = out / "a" / "ckpt" / "last.ckpt"
    assert (ckpt / "meta.pt").is_file() and len(list(ckpt.glob("*.distcp"))) == 2
    resumed = _metrics(out / "b")
    assert resumed["global_step"] == 30 and len(resumed["losses"]) == 10, "it continued from step 20"
