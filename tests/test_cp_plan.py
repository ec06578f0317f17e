"""Context parallelism's plan (#52), one process: each rank's activations on its seq/C tokens, the Ulysses and
ring bytes per step against formulas written out here, and ``plan --memory --grow-seq``'s longest sequence."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from models import llama

from bmt_wrap.base.cp_plan import ContextParallelPlan
from bmt_wrap.cli import main
from bmt_wrap.passes import as_call, plan_context_parallel
from bmt_wrap.plan import WrapPlan

MODELS = str(Path(__file__).with_name("models.py"))
# tests/models.py's llama: 2 layers, 4 heads, 2 KV heads, width 32 (head dim 8), float32
HEADS, KV, DIM, LAYERS, F32 = 4, 2, 8, 2, 4


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["plan", f"{MODELS}:llama", *argv]) == 0
    return capsys.readouterr().out


def _kib(text: str, label: str) -> float:
    """The estimates table's row ``label`` (one column), in KiB."""
    return float(re.search(rf"^  {label}\s+([\d.]+) KiB$", text, re.M)[1])  # type: ignore[index]


def _section(method: str, cp: int, batch: int, seq: int, recomputed: int = LAYERS) -> ContextParallelPlan:
    import torch

    call = as_call({"input_ids": torch.zeros(batch, seq, dtype=torch.int64)})
    return plan_context_parallel(llama(), cp, method, call, recomputed=recomputed)


@pytest.mark.parametrize("cp", [2, 4])
def test_ulysses_bytes_per_step(cp: int) -> None:
    b, s = 2, 64
    local = s // cp
    q = b * HEADS * local * DIM * F32
    kv = b * (KV if KV >= cp else HEADS) * local * DIM * F32  # fewer KV heads than ranks: repeated to the queries
    per_call = (2 * q + 2 * kv) * (cp - 1) / cp  # q, k, v and the output, (C-1)/C of each leaves the rank
    index = (1 + b) * local * 8 * (cp - 1)
    moved = _section("auto", cp, b, s).exchange()
    assert _section("auto", cp, b, s).method == "ulysses"
    assert moved == {"forward": LAYERS * (per_call + index), "backward": LAYERS * per_call,
                     "recompute": LAYERS * (per_call + index), "step": LAYERS * (3 * per_call + 2 * index)}


def test_ulysses_holds_the_whole_sequences_mask_only_with_padding() -> None:
    import torch

    b, s, cp = 1, 256, 2
    copy = 2 * b * HEADS * (s // cp) * DIM * F32 + 2 * b * KV * (s // cp) * DIM * F32  # q, k, v and the output
    padded = as_call({"input_ids": torch.zeros(b, s, dtype=torch.int64),
                      "attention_mask": torch.ones(b, s, dtype=torch.int64)})
    # padding: the exchanged copies, the [b, 1, S, S] bool mask and CPU SDPA's float bias of it; none: SDPA's
    # is_causal, and beyond the local call's own saved tensors only the output's copy in the local layout
    assert plan_context_parallel(llama(), cp, "ulysses", padded).attention_bytes() == 2 * copy + b * s * s * 5
    assert _section("ulysses", cp, b, s).attention_bytes() == b * HEADS * (s // cp) * DIM * F32
    # K/V heads fewer than the ranks: each rank saves its query heads' repeated K/V, not the local KV heads'
    assert _section("ulysses", 4, b, s).attention_bytes() == b * (3 * HEADS - 2 * KV) * (s // 4) * DIM * F32


def test_ring_bytes_per_step_and_auto_picks_the_ring_with_too_few_heads() -> None:
    b, s, cp = 1, 128, 8
    local = s // cp
    kv = 2 * b * KV * local * DIM * F32
    forward = LAYERS * (kv * (cp - 1) + (1 + b) * local * 8 * (cp - 1))
    backward = LAYERS * (kv * (cp - 1) + kv * cp)  # K/V around again, dK/dV (fp32) around to their owners
    section = _section("auto", cp, b, s, recomputed=1)
    assert section.method == "ring"  # 4 heads < 8 ranks
    assert section.exchange() == {"forward": forward, "backward": backward, "recompute": forward // LAYERS,
                                  "step": forward + backward + forward // LAYERS}
    assert _section("ring", 2, b, s).method == "ring"


def test_plan_cp_size_counts_a_rank_on_its_part_of_the_sequence(capsys: pytest.CaptureFixture[str]) -> None:
    whole = _plan(capsys, "--world-size", "2", "--input", "input_ids=int64[1,128]", "--input", "labels=int64[1,128]")
    cp2 = _plan(capsys, "--world-size", "2", "--cp-size", "2", "--input", "input_ids=int64[1,128]",
                "--input", "labels=int64[1,128]")
    half = _plan(capsys, "--world-size", "2", "--input", "input_ids=int64[1,64]", "--input", "labels=int64[1,64]")
    # A rank's activations are those of its 64 tokens, about half of the 128 tokens' without CP.
    assert _kib(cp2, "activations") == _kib(half, "activations")
    assert 0.45 < _kib(cp2, "activations") / _kib(whole, "activations") < 0.55
    assert "context parallelism: cp_size=2, ulysses over 2 attention(s) (4 heads, 2 KV heads, head dim 8" in cp2
    assert "each rank holds 64 of 128 tokens x batch 1" in cp2
    step = _section("auto", 2, 1, 128).exchange()["step"]  # type: ignore[index]
    assert f"ulysses bytes sent per rank per step: {step / 1024:.2f} KiB" in cp2
    ring = _plan(capsys, "--world-size", "2", "--cp-size", "2", "--cp-method", "ring",
                 "--input", "input_ids=int64[1,128]")
    assert "context parallelism: cp_size=2, ring over 2 attention(s)" in ring


def test_plan_cp_size_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", f"{MODELS}:llama", "--world-size", "3", "--cp-size", "2", "--input",
                 "input_ids=int64[1,64]"]) == 2
    assert "--cp-size 2 must divide every --world-size" in capsys.readouterr().err
    assert main(["plan", f"{MODELS}:llama", "--world-size", "2", "--cp-size", "2", "--input",
                 "input_ids=int64[1,66]"]) == 1
    assert "does not divide into 2 x cp_size = 4 equal chunks" in capsys.readouterr().err
    assert main(["plan", f"{MODELS}:llama", "--world-size", "2", "--cp-size", "2"]) == 2
    assert "--cp-size splits the input's sequence" in capsys.readouterr().err


def test_the_section_round_trips_and_prints() -> None:
    section = _section("auto", 2, 1, 64)
    plan = WrapPlan(groups=[], context_parallel=section)
    assert WrapPlan.from_json(plan.to_json()).context_parallel == section
    assert "context parallelism: cp_size=2, ulysses over 2 attention(s)" in str(plan)


def _memory(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["plan", f"{MODELS}:llama", "--world-size", "2", "--cp-size", "2", "--memory", "520MiB",
                 "--baseline", "200MiB", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_grow_seq_answers_the_longest_sequence_that_fits(capsys: pytest.CaptureFixture[str]) -> None:
    step = 256
    answer = _memory(capsys, "--grow-seq", str(step), "--input", "input_ids=int64[1,256]",
                     "--input", "labels=int64[1,256]")
    seq = answer["value"]
    assert answer["grow"] == "seq_len" and seq % step == 0 and seq >= 2 * step
    at = _memory(capsys, "--input", f"input_ids=int64[1,{seq}]", "--input", f"labels=int64[1,{seq}]")
    over = _memory(capsys, "--input", f"input_ids=int64[1,{seq + step}]", "--input",
                   f"labels=int64[1,{seq + step}]")
    # The answer fits with the margin; one step more does not (the count grows with the sequence).
    assert at["fits"] and at["peak_per_rank"] == answer["peak_per_rank"]
    assert at["peak_per_rank"] == round(at["counted_per_rank"] * 1.04)
    assert not over["fits"] and over["peak_per_rank"] > answer["limit_per_rank"]
