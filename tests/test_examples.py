"""Smoke tests of examples/: each runs under torchrun on 2 ranks at tiny sizes and does what it claims.
finetune_hf.py, train_gpt.py and bmtrain_style.py run one after another in one 2-rank job (tests/in_job.py,
each as ``python examples/<script>`` runs it), so the job's start-up is paid once; train_gpt.py's resume
and bmtrain_style.py on 4 ranks are jobs of their own, as users run them. The examples for transformers'
Trainer, accelerate and Lightning are tested in tests/test_integrations.py, in each tool's job."""

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
from in_job import sections

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"
TINY_GPT = ["--steps", "30", "--d-model", "64", "--layers", "2", "--heads", "2", "--seq", "64", "--batch", "4",
            "--corpus-mb", "2", "--warmup", "5", "--save-every", "10", "--sample", "20", "--no-progress"]
TINY_BMTRAIN = ["--layers", "2", "--dim", "64", "--seq", "32", "--batch", "4", "--log-every", "1"]


def torchrun(script: Path, *args: str, ranks: int = 2) -> str:
    """Run ``script`` on ``ranks`` ranks; its stdout then stderr, failing the test with them on a non-zero exit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                           str(script), *args], env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script.name} exited {proc.returncode}:\n{output[-6000:]}"
    return output


@pytest.fixture(scope="module")
def examples_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """One 2-rank job: finetune_hf.py first (its first ``init_distributed`` seeds it as a job of its own
    would), an uninterrupted tiny train_gpt.py (parameter tables every 15 steps), bmtrain_style.py; their
    outputs under OUT/<script's stem>, rank 0's log of each by script."""
    out = tmp_path_factory.mktemp("examples")
    # finetune_hf: 60 steps instead of the default 186; the accuracy still clears chance by over 0.25
    finetune = ["finetune_hf.py", "--train-size", "960", "--epochs", "2", "--eval-size", "200", "--lr", "2e-3",
                "--out-dir", str(out / "finetune_hf")]
    gpt = ["train_gpt.py", *TINY_GPT, "--inspect-every", "15", "--out-dir", str(out / "train_gpt")]
    bmtrain = ["bmtrain_style.py", *TINY_BMTRAIN, "--steps", "40", "--save", str(out / "bmtrain_style.safetensors")]
    log = torchrun(HERE / "in_job.py", json.dumps([finetune, gpt, bmtrain]))
    logs = sections(log)
    assert sorted(logs) == ["bmtrain_style.py", "finetune_hf.py", "train_gpt.py"], log[-6000:]
    return out, logs


def _bmtrain_losses(log: str) -> list[float]:
    return [float(x) for x in re.findall(r"\| Iter:\s+\d+ \| loss: ([0-9.]+)", log)]


def test_train_gpt_loss_falls_and_writes_its_outputs(examples_run: tuple[Path, dict[str, str]]) -> None:
    out, log = examples_run[0] / "train_gpt", examples_run[1]["train_gpt.py"]
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


def test_train_gpt_resume_continues_exactly(examples_run: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    """Resume from the uninterrupted run's last periodic checkpoint (step 20) and stop at 25 as if
    preempted: the losses it saves are the uninterrupted run's, bit for bit, and it writes no metrics."""
    full = examples_run[0] / "train_gpt"
    shutil.copytree(full / "checkpoint", tmp_path / "checkpoint")
    assert _saved_losses(tmp_path / "checkpoint")[0] == 20
    log = torchrun(EXAMPLES / "train_gpt.py", *TINY_GPT, "--resume", "--stop-at", "25", "--out-dir", str(tmp_path))
    assert "resumed from step 20" in log and "stopped at step 25" in log
    assert not (tmp_path / "metrics.json").exists()
    step, resumed = _saved_losses(tmp_path / "checkpoint")
    uninterrupted = json.loads((full / "metrics.json").read_text())["losses"]
    assert step == 25 and resumed == uninterrupted[:25], "resume + stop at 25 gives the uninterrupted run's losses"


def test_finetune_hf_beats_chance_and_its_file_loads_back(examples_run: tuple[Path, dict[str, str]]) -> None:
    out = examples_run[0] / "finetune_hf"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["accuracy"] >= metrics["majority"] + 0.1, metrics
    assert metrics["reloaded_accuracy"] == pytest.approx(metrics["accuracy"]), "transformers reloads the same model"
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForSequenceClassification

    plain = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(out))
    result = plain.load_state_dict(load_file(out / "model.safetensors"), strict=True)
    assert not result.missing_keys and not result.unexpected_keys


def test_bmtrain_style_trains_and_saves(examples_run: tuple[Path, dict[str, str]]) -> None:
    losses = _bmtrain_losses(examples_run[1]["bmtrain_style.py"])
    assert len(losses) == 40
    assert sum(losses[-10:]) <= 0.8 * sum(losses[:10]), losses
    from safetensors.torch import load_file

    state = load_file(examples_run[0] / "bmtrain_style.safetensors")
    assert state["word_emb.weight"].shape == (256, 64)
    assert state["transformers.1.attn.project_q.weight"].shape == (64, 64)


def test_bmtrain_style_trains_with_tensor_parallelism_on_4_ranks(tmp_path: Path) -> None:
    """BMTrain's example as it asks, init_distributed(tp_size=2): tp 2 x dp 2, the loss falls, and the
    saved file holds whole tensors under the plain model's names and shapes."""
    path = tmp_path / "gpt.safetensors"
    log = torchrun(EXAMPLES / "bmtrain_style.py", "--tp-size", "2", "--steps", "30", *TINY_BMTRAIN, "--save", str(path),
                   ranks=4)
    losses = _bmtrain_losses(log)
    assert len(losses) == 30
    assert sum(losses[-10:]) <= 0.8 * sum(losses[:10]), losses
    from safetensors.torch import load_file

    state = load_file(path)
    assert state["word_emb.weight"].shape == (256, 64)
    assert state["transformers.1.attn.project_q.weight"].shape == (64, 64)
    assert state["transformers.1.ff.w_out.weight"].shape == (64, 256)
