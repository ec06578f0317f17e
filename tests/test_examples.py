"""Smoke tests of examples/: each runs under torchrun on 2 ranks at tiny sizes and does what it claims."""

from __future__ import annotations

import json
import os
import re
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


def test_train_gpt_resume_continues_exactly(gpt_run: tuple[Path, str], tmp_path: Path) -> None:
    full, _ = gpt_run
    torchrun("train_gpt.py", *TINY_GPT, "--stop-at", "20", "--out-dir", str(tmp_path))
    assert not (tmp_path / "metrics.json").exists()
    log = torchrun("train_gpt.py", *TINY_GPT, "--resume", "--out-dir", str(tmp_path))
    assert "resumed from step 20" in log
    resumed = json.loads((tmp_path / "metrics.json").read_text())["losses"]
    uninterrupted = json.loads((full / "metrics.json").read_text())["losses"]
    assert resumed == uninterrupted, "stop at 20 + resume gives the uninterrupted run's losses, bit for bit"


def test_finetune_hf_beats_chance_and_its_file_loads_back(tmp_path: Path) -> None:
    torchrun("finetune_hf.py", "--out-dir", str(tmp_path))
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


TINY_LM = ["--layers", "2", "--dim", "64", "--seq", "64"]


def test_trainer_finetune_learns_and_plain_transformers_reloads_it(tmp_path: Path) -> None:
    torchrun("trainer_finetune.py", *TINY_LM, "--steps", "30", "--save-every", "20", "--out-dir", str(tmp_path))
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["losses"][-1] <= 0.8 * metrics["losses"][0], metrics["losses"]
    assert metrics["reloaded_eval_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-5)
    assert (tmp_path / "checkpoint-20" / "optimizer_sharded" / ".metadata").is_file()


def test_accelerate_loop_learns_and_resumes_exactly(tmp_path: Path) -> None:
    args = [*TINY_LM, "--steps", "30"]
    torchrun("accelerate_loop.py", *args, "--out-dir", str(tmp_path / "full"))
    torchrun("accelerate_loop.py", *args, "--stop-at", "20", "--out-dir", str(tmp_path / "split"))
    log = torchrun("accelerate_loop.py", *args, "--resume", "--out-dir", str(tmp_path / "split"))
    assert "resumed from step 20" in log
    full = json.loads((tmp_path / "full" / "metrics.json").read_text())["losses"]
    split = json.loads((tmp_path / "split" / "metrics.json").read_text())["losses"]
    assert split == full, "stop at 20 + load_state gives the uninterrupted run's losses, bit for bit"
    assert sum(full[-5:]) <= 0.8 * sum(full[:5]), full
    assert (tmp_path / "full" / "final" / "model.safetensors").is_file()


def test_lightning_module_learns_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    args = [*TINY_LM, "--save-every", "10"]
    torchrun("lightning_module.py", *args, "--steps", "20", "--out-dir", str(tmp_path / "a"))
    first = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert first["global_step"] == 20 and sum(first["losses"][-5:]) <= 0.8 * sum(first["losses"][:5]), first
    ckpt = tmp_path / "a" / "ckpt" / "last.ckpt"
    assert (ckpt / "meta.pt").is_file() and len(list(ckpt.glob("*.distcp"))) == 2
    torchrun("lightning_module.py", *args, "--steps", "30", "--resume", str(ckpt), "--out-dir", str(tmp_path / "b"))
    resumed = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert resumed["global_step"] == 30 and len(resumed["losses"]) == 10, "it continued from step 20"
