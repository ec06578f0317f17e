"""Smoke tests of examples/: each runs under torchrun on 2 ranks at tiny sizes and does what it claims.
The examples for transformers' Trainer, accelerate and Lightning are tested in tests/test_integrations.py,
in the same job as each tool's comparison with DDP."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TINY_GPT = ["--steps", "30", "--d-model", "64", "--layers", "2", "--heads", "2", "--seq", "64", "--batch", "4",
            "--corpus-mb", "2", "--warmup", "5", "--save-every", "10", "--sample", "20", "--no-progress"]


def torchrun(script: str, *args: str, ranks: int = 2) -> str:
    """Run ``examples/<script>`` on ``ranks`` ranks; return its output, failing the test with it on a non-zero exit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                           str(EXAMPLES / script), *args], env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{output[-6000:]}"
    return output


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One uninterrupted tiny train_gpt.py run (with parameter tables every 15 steps)."""
    out = tmp_path_factory.mktemp("train_gpt")
    return out, torchrun("train_gpt.py", *TINY_GPT, "--inspect-every", "15", "--out-dir", str(out))


def test_train_gpt_loss_falls_and_writes_its_outputs(gpt_run: tuple[Path, str]) -> None:
    out, log = gpt_run
    metrics = json.loads((out / "metrics.json").read_text())
    losses = metrics["losses"]
    assert len(losses) == 30
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last <= 0.8 * first, f"mean loss of the last 10 steps {last:.3f} > 0.8 x the first 10's {first:.3f}"
    assert (out / "loss.png").stat().st_size > 0
    assert log.count("parameters after step") == 2
    table = re.search(r"^\s*name\s+shape\s+max\s+min\s+std\s+mean\s+grad_std\s+grad_mean", log, re.M)  # BMTrain's
    assert table, "--inspect-every prints the inspect_model table"
    assert "blocks.1.fc.weight" in log
    # The consolidated model holds full tensors under the plain model's names (the tied head under both).
    from safetensors.torch import load_file

    state = load_file(out / "model.safetensors")
    assert state["blocks.0.qkv.weight"].shape == (192, 64)
    assert torch.equal(state["tok.weight"], state["head.weight"])


def _saved_losses(ckpt: Path) -> tuple[int, list[float]]:
    """(step, losses so far) that train_gpt.py keeps in a checkpoint (its ``extra``, in rank 0's state file)."""
    meta = json.loads((ckpt / "metadata.json").read_text())
    return meta["step"], torch.load(ckpt / meta["files"][0]["state"], weights_only=True)["extra"]["losses"]


def test_train_gpt_resume_continues_exactly(gpt_run: tuple[Path, str], tmp_path: Path) -> None:
    """Resume from the uninterrupted run's last periodic checkpoint (step 20) and stop at 25 as if
    preempted: the losses it saves are the uninterrupted run's, bit for bit, and it writes no metrics."""
    full, _ = gpt_run
    shutil.copytree(full / "checkpoint", tmp_path / "checkpoint")
    assert _saved_losses(tmp_path / "checkpoint")[0] == 20
    log = torchrun("train_gpt.py", *TINY_GPT, "--resume", "--stop-at", "25", "--out-dir", str(tmp_path))
    assert "resumed from step 20" in log and "stopped at step 25" in log
    assert not (tmp_path / "metrics.json").exists()
    step, resumed = _saved_losses(tmp_path / "checkpoint")
    uninterrupted = json.loads((full / "metrics.json").read_text())["losses"]
    assert step == 25 and resumed == uninterrupted[:25], "resume + stop at 25 gives the uninterrupted run's losses"


def test_finetune_hf_beats_chance_and_its_file_loads_back(tmp_path: Path) -> None:
    # 60 steps instead of the default 186: the accuracy still clears chance by over 0.25 (0.77 vs 0.505)
    torchrun("finetune_hf.py", "--train-size", "960", "--epochs", "2", "--eval-size", "200", "--lr", "2e-3",
             "--out-dir", str(tmp_path))
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["accuracy"] >= metrics["majority"] + 0.1, metrics
    assert metrics["reloaded_accuracy"] == pytest.approx(metrics["accuracy"]), "transformers reloads the same model"
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForSequenceClassification

    plain = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(tmp_path))
    result = plain.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=True)
    assert not result.missing_keys and not result.unexpected_keys


def test_bmtrain_style_trains_and_saves(tmp_path: Path) -> None:
    path = tmp_path / "gpt.safetensors"
    log = torchrun("bmtrain_style.py", "--steps", "40", "--layers", "2", "--dim", "64", "--seq", "32",
                   "--batch", "4", "--log-every", "1", "--save", str(path))
    losses = [float(x) for x in re.findall(r"\| Iter:\s+\d+ \| loss: ([0-9.]+)", log)]
    assert len(losses) == 40
    assert sum(losses[-10:]) <= 0.8 * sum(losses[:10]), losses
    from safetensors.torch import load_file

    state = load_file(path)
    assert state["word_emb.weight"].shape == (256, 64)
    assert state["transformers.1.attn.project_q.weight"].shape == (64, 64)


def test_bmtrain_style_trains_with_tensor_parallelism_on_4_ranks(tmp_path: Path) -> None:
    """BMTrain's example as it asks, init_distributed(tp_size=2): tp 2 x dp 2, the loss falls, and the
    saved file holds whole tensors under the plain model's names and shapes."""
    path = tmp_path / "gpt.safetensors"
    log = torchrun("bmtrain_style.py", "--tp-size", "2", "--steps", "30", "--layers", "2", "--dim", "64", "--seq", "32",
                   "--batch", "4", "--log-every", "1", "--save", str(path), ranks=4)
    losses = [float(x) for x in re.findall(r"\| Iter:\s+\d+ \| loss: ([0-9.]+)", log)]
    assert len(losses) == 30
    assert sum(losses[-10:]) <= 0.8 * sum(losses[:10]), losses
    from safetensors.torch import load_file

    state = load_file(path)
    assert state["word_emb.weight"].shape == (256, 64)
    assert state["transformers.1.attn.project_q.weight"].shape == (64, 64)
    assert state["transformers.1.ff.w_out.weight"].shape == (64, 256)
