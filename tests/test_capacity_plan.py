"""``bmt-wrap plan --memory``: a training process's peak per rank (max(the process before its first step +
wrapping, baseline + training by phase)) and the largest ``--grow`` value under a limit. Measured peaks against these
predictions are the capacity benchmark's (benchmarks/capacity.py), not a unit test's."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bmt_wrap.cli import main
from bmt_wrap.errors import PlanError
from bmt_wrap.passes import build_plan, capture, discover_blocks
from bmt_wrap.passes.capacity import (
    MARGIN,
    ProcessPeak,
    largest_fitting,
    optimizer_on_disk,
    pipeline_peak,
    process_peak,
    training_peak,
    training_phases,
)
from bmt_wrap.passes.pipeline import estimate_pipeline, plan_pipeline

TOY = str(Path(__file__).with_name("toy.py"))
MIB = 2**20
#: One rank's batch as the CLI takes it (token ids and targets) and as the plans below capture it.
INPUT = ["--input", "int64[2,16]", "--input", "int64[2,16]"]


def _toy_inputs():
    ids = torch.empty(2, 16, dtype=torch.int64, device="meta")
    return (ids, ids), {}


def _plan(n_layers: int, world_size: int = 2, tied: bool = True, offload: str | None = None,
          inputs: bool = False):
    """The plan the CLI makes of toy.py:ToyGPT --grow n_layers (with ``inputs``, for ``INPUT``'s batch)."""
    from toy import ToyGPT

    with torch.device("meta"):
        model = ToyGPT(n_layers=n_layers, tied=tied)
    discovery = discover_blocks(model)
    captured = capture(model, discovery, _toy_inputs() if inputs else None)
    plan = build_plan(model, discovery, world_size=world_size, capture=captured, offload=offload)
    return plan, plan.estimates[str(world_size)]


def _peak(n_layers: int, baseline: int, streaming: bool = False) -> int:
    plan, est = _plan(n_layers, inputs=True)
    return process_peak(plan, est, baseline, built_full=not streaming, margin_fraction=MARGIN).total


@given(st.lists(st.integers(1, 50), min_size=1, max_size=60), st.integers(0, 3000), st.integers(1, 40))
def test_largest_fitting_is_the_last_k_whose_peak_fits(steps: list[int], limit: int, start: int) -> None:
    peaks = [sum(steps[:k]) for k in range(1, len(steps) + 1)]  # increasing in k
    peak_of = lambda k: peaks[k - 1] if k <= len(peaks) else 10**9  # noqa: E731
    if peaks[0] > limit:
        with pytest.raises(PlanError, match="even the smallest model"):
            largest_fitting(peak_of, limit, start)
        return
    k, peak = largest_fitting(peak_of, limit, start)
    assert peak == peaks[k - 1] <= limit and (k == len(peaks) or peaks[k] > limit)


@pytest.mark.parametrize("answer", [1, 7, 58, 300, 821])
@pytest.mark.parametrize("square", [0, 5])
def test_largest_fitting_probes_nearly_affine_or_quadratic_peaks_a_few_times(answer: int, square: int) -> None:
    """Each probe captures a model; peaks nearly affine (layers) or quadratic (a sequence's length: attention's
    scores) in k, with a little noise, are settled in a handful of probes (doubling then bisection took 10 to
    reach 58 from 8, and 12 to reach a CP sequence of 821 steps)."""
    probed: list[int] = []

    def peak_of(k: int) -> int:
        probed.append(k)
        return 10_000 + 1_000 * k + square * k * k + (k * 37) % 101

    k, _ = largest_fitting(peak_of, peak_of(answer) + 500, start=8)
    probed.pop(0)  # the limit's own
    assert k == answer and len(probed) <= 6, probed


def _root_shards(plan, world_size: int = 2) -> int:
    return sum(b.shard_numel(world_size) * 4 for g in plan.groups if g.is_root for b in g.buffers)


def test_process_peak_adds_the_root_backward_and_the_full_copy_before_wrapping() -> None:
    plan, est = _plan(4)
    root_grads = sum(b.full_grad_bytes(2) for g in plan.groups if g.is_root for b in g.buffers)
    built = process_peak(plan, est, baseline=100 * MIB, beside=3 * MIB)
    # By phase: backward's start holds the activations and the head's gradient, the blocks' backward end
    # every block's gradient shard, and the root's gradient, after the blocks, the root's full gradient.
    # Without its graph the head is unknown, so the whole root's gradient stands for the head's.
    # After the blocks, a tied weight's second use makes its gradient and their sum: the toy GPT ties
    # its head to its embedding.
    wte = next(slot for b in plan.group("root").buffers for slot in b.slots if slot.fqn == "wte.weight")
    assert wte.aliases, "the toy GPT ties its head to its embedding"
    held = est.params + est.optimizer + est.gathered
    phases = training_phases(plan, est)
    assert phases["backward start"] == held + root_grads + (est.activations or 0)
    assert phases["blocks' backward end"] == (held + root_grads + est.grads - _root_shards(plan)
                                              + est.grads_in_flight)
    # The root's shard is written after its gradient is gone: every shard but the root's beside it.
    assert phases["root's gradient"] == (held + root_grads + 2 * 4 * wte.numel + est.grads
                                         - _root_shards(plan))
    assert built.training == max(phases.values())
    # Wrapping: the full copy, and at its peak (here the first block's, whose buffer outweighs the root's)
    # the root's shard, less the root's originals, gone once it was made, beside the block's shard and its
    # buffer packed whole for the broadcast.
    root, first = plan.groups[0], plan.groups[1]
    assert root.is_root and len(root.buffers) == len(first.buffers) == 1
    assert built.wrapping == (sum(g.param_bytes() for g in plan.groups) + root.buffers[0].shard_numel(2) * 4
                              - root.param_bytes() + first.buffers[0].shard_numel(2) * 4
                              + first.buffers[0].padded_numel(2) * 4)
    assert built.total == 103 * MIB + max(built.wrapping, built.training)
    streamed = process_peak(plan, est, baseline=100 * MIB, built_full=False)
    assert streamed.wrapping == 0 and streamed.total == 100 * MIB + built.training


def test_wrapping_sits_on_the_process_before_its_first_step() -> None:
    """Wrapping runs before the first step, which leaves tens of MiB for good (kernels paged in, the
    autograd engine, the optimizer's module): its peak sits on the process as it was before, training's on
    the baseline (a 2-rank Qwen2 on disk at 30 layers: the plan's peak was wrapping's, counted on the
    baseline's 405 MiB where the process held 376 before its first step)."""
    plan, est = _plan(4)
    lower = process_peak(plan, est, baseline=100 * MIB, beside=3 * MIB, wrapping_baseline=70 * MIB)
    assert lower.wrapping_baseline == 70 * MIB
    assert lower.total == 3 * MIB + max(70 * MIB + lower.wrapping, 100 * MIB + lower.training)
    # Wrapping's peak (a large model built whole) moves with the process before the first step ...
    wrapping_peak = ProcessPeak(baseline=100 * MIB, wrapping=80 * MIB, training=40 * MIB, beside=3 * MIB)
    assert wrapping_peak.total == 183 * MIB
    assert replace(wrapping_peak, wrapping_baseline=70 * MIB).total == 153 * MIB
    # ... down to training's, which stays on the whole baseline however low the process starts.
    assert replace(wrapping_peak, wrapping_baseline=0).total == 143 * MIB


def test_the_heads_gradient_is_held_only_until_the_blocks_backward() -> None:
    """The root's first use in backward is the vocabulary head: at backward's start only its gradient exists;
    the embedding's comes after the blocks (measured on a 2-rank Llama of width 384 at 14 layers: counting
    the root's whole gradient there put the plan 3.5% over the process's peak). An untied head is alone in
    its buffer, reduce-scattered before the blocks' backward (#35): the blocks' backward end holds only its
    shard, and the root's gradient after the blocks is the rest of the root's."""
    from models import VOCAB, llama, token_ids

    from bmt_wrap.passes.fused_loss import fused_loss_section, with_fused_loss

    model = llama()
    ids = token_ids(batch=2, seq=16)
    d = discover_blocks(model)
    cap = capture(model, d, ((), {"input_ids": ids, "labels": ids}))
    section = fused_loss_section(model, cap, enabled=False)
    plan = build_plan(model, d, world_size=2, capture=with_fused_loss(cap, section))
    est = plan.estimates["2"]
    head = model.lm_head.weight.numel() * 4
    assert section.weight == "lm_head.weight" and 0 < head < _root_grad_bytes(plan)
    alone = next(b for b in plan.group("root").buffers if [s.fqn for s in b.slots] == ["lm_head.weight"])
    early = alone.full_grad_bytes(2)
    held = est.params + est.optimizer + est.gathered
    phases = training_phases(plan, est)
    assert phases["backward start"] == held + head + est.activations - est.activations_recompute
    # The head's gradient shard, made by its early reduce-scatter, is held there with the blocks'; only the
    # rest of the root's shard is still to come.
    head_shard = alone.shard_numel(2) * 4
    assert phases["blocks' backward end"] == (held + est.grads - (_root_shards(plan) - head_shard)
                                              + est.grads_in_flight + est.activations_recompute
                                              + est.activations_objects)
    # an untied root: one name, one use, so no use's gradient waits beside the full one
    full = _root_grad_bytes(plan) - early
    assert phases["root's gradient"] == held + full + est.grads - (_root_shards(plan) - head_shard)
    assert VOCAB * model.config.hidden_size * 4 == head


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_roots_shard_is_written_after_its_gradient_is_gone(world_size: int) -> None:
    """After the blocks the root's reduce-scatter starts from a copy of its gradient in the gathered storage
    and writes the shard as the other ranks' pieces arrive, on the communicator's thread; the gradient
    autograd made goes when the root's backward node returns, before they arrive. So the root's shard (and
    at more than 2 ranks the ring's scratch piece) never sits beside that gradient: counting the shard and
    a receipt of (N-1)/N beside it put the plan 125 MiB a rank over the fused Llama of
    benchmarks/fused_loss.py at 512 tokens (plan 961, measured 835 MiB above the baseline)."""
    from models import llama, token_ids

    from bmt_wrap.passes.fused_loss import fused_loss_section, with_fused_loss

    model = llama()
    ids = token_ids(batch=2, seq=16)
    d = discover_blocks(model)
    cap = capture(model, d, ((), {"input_ids": ids, "labels": ids}))
    section = fused_loss_section(model, cap, enabled=True)
    plan = build_plan(model, d, world_size=world_size, capture=with_fused_loss(cap, section))
    est = plan.estimates[str(world_size)]
    root = plan.group("root").buffers
    head = next(b for b in root if [s.fqn for s in b.slots] == ["lm_head.weight"])
    late = [b for b in root if b is not head and b.requires_grad]
    full = sum(b.full_grad_bytes(world_size) for b in late)
    late_shards = sum(b.shard_numel(world_size) * 4 for b in late)
    held = est.params + est.optimizer + est.gathered
    root_phase = training_phases(plan, est)["root's gradient"]
    assert root_phase == held + full + est.grads - late_shards
    # Once the gradient is gone every shard is whole, with the ring's scratch piece beside them at more
    # than 2 ranks: less than the moment before.
    scratch = late_shards if world_size > 2 else 0
    assert held + est.grads + scratch <= root_phase


def _root_grad_bytes(plan) -> int:
    return sum(b.full_grad_bytes(2) for g in plan.groups if g.is_root for b in g.buffers if b.requires_grad)


def test_plan_memory_grow_answers_the_largest_layer_count(capsys: pytest.CaptureFixture[str]) -> None:
    baseline = 50 * MIB
    limit = 2 * _peak(6, baseline) + 1  # over 2 ranks: exactly 6 layers fit
    code = main(["plan", f"{TOY}:ToyGPT", "--world-size", "2", "--memory", str(limit), "--grow", "n_layers",
                 "--baseline", str(baseline), "--json", *INPUT])
    out, err = capsys.readouterr()
    assert code == 0, err
    answer = json.loads(out)
    assert answer["layers"] == 6 and answer["peak_per_rank"] == _peak(6, baseline)
    assert _peak(7, baseline) > limit // 2
    # The answer keeps the count's known error beside it (issue 49: answered at the count, jobs peaked up to
    # 3.4% over B): the count of the answer fits the limit with room for that margin.
    assert MARGIN > 0 and answer["margin"] == round(answer["counted_per_rank"] * MARGIN) > 0
    assert answer["counted_per_rank"] * (1 + MARGIN) <= limit // 2 + 1
    assert answer["fits"] and answer["baseline"] == baseline and answer["limit_per_rank"] == limit // 2
    assert answer["assumes"] == "MALLOC_MMAP_THRESHOLD_=65536"


_SIZE = r"(\d+(?:\.\d+)?) (B|KiB|MiB|GiB|TiB)"
_SUM = re.compile(rf"peak per rank {_SIZE} = (?:{_SIZE} beside the layers' tensors \+ )?max\(wrapping {_SIZE} \+ "
                  rf"the process before its first step {_SIZE}, training {_SIZE} at its peak \(([^)]+)\) \+ the "
                  rf"process baseline {_SIZE}\)(?: \+ margin {_SIZE} \((\d+)% of the count: [^)]+\))?")


def _printed_sum(out: str) -> dict[str, object]:
    """The terms of ``plan --memory``'s printed peak, each as (bytes, the half unit its rounding may hide)."""
    match = _SUM.search(out)
    assert match, out
    g = match.groups()
    unit = dict(B=1, KiB=2**10, MiB=2**20, GiB=2**30, TiB=2**40)

    def size(i: int) -> tuple[float, float] | None:
        if g[i] is None:
            return None
        return float(g[i]) * unit[g[i + 1]], (0.5 if g[i + 1] == "B" else 0.005) * unit[g[i + 1]] + 1e-6

    return {"total": size(0), "beside": size(2), "wrapping": size(4), "before": size(6), "training": size(8),
            "phase": g[10], "baseline": size(11), "margin": size(13), "percent": g[15]}


@pytest.mark.parametrize("extra", [[], ["--grow", "n_layers"], ["--offload", "disk", "--optimizer-state", "disk"],
                                   ["--streaming"]])
def test_plan_memory_prints_a_sum_that_adds_up(capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    """Every term of the printed peak, added as printed, gives the printed total (within each one's rounding).
    It printed "training 471.11 MiB: the plan's 490.68 MiB + the root's backward": a whole smaller than a part
    (the estimate's terms summed, though they peak at different phases)."""
    argv = ["plan", f"{TOY}:ToyGPT", "--world-size", "2", "--memory", str(2 * _peak(6, 100 * MIB) + 1),
            "--baseline", "100MiB", *INPUT, *extra]
    code = main([*argv, "--json"])
    answer = json.loads(capsys.readouterr().out)
    assert code == 0
    assert main(argv) == 0
    out = capsys.readouterr().out
    terms = _printed_sum(out)
    parts = [terms["beside"] or (0.0, 0.0), terms["margin"] or (0.0, 0.0)]
    wrapping = terms["wrapping"][0] + terms["before"][0]
    training = terms["training"][0] + terms["baseline"][0]
    added = parts[0][0] + max(wrapping, training) + parts[1][0]
    slack = sum(t[1] for t in (terms["total"], *parts, terms["wrapping"], terms["before"], terms["training"],
                               terms["baseline"]))
    assert abs(added - terms["total"][0]) <= slack, (terms, added)
    # ... and each printed term is the answer's own, not a figure beside it
    for key, value in (("total", answer["peak_per_rank"]), ("wrapping", answer["wrapping"]),
                       ("training", max(answer["training_phases"].values())), ("baseline", answer["baseline"]),
                       ("margin", answer["margin"] if answer["margin"] else None)):
        assert (terms[key] is None) == (value is None) and (value is None or abs(terms[key][0] - value)
                                                            <= terms[key][1]), (key, terms[key], value)
    assert terms["phase"] == max(answer["training_phases"], key=answer["training_phases"].get)
    assert answer["peak_per_rank"] == answer["counted_per_rank"] + answer["margin"]
    assert "beside the layers' tensors" not in out  # a given --baseline measures nothing per layer
    # The allocator setting the count is exact for (docs/design.md "Capacity") is stated with the answer.
    assert "exact for a job run with MALLOC_MMAP_THRESHOLD_=65536" in out


def test_streaming_never_predicts_more(capsys: pytest.CaptureFixture[str]) -> None:
    answers = []
    limit = str(2 * _peak(6, 0) + 1)
    for extra in ([], ["--streaming"]):
        assert main(["plan", f"{TOY}:ToyGPT", "--world-size", "2", "--memory", limit, "--grow", "n_layers",
                     "--baseline", "0", "--json", *INPUT, *extra]) == 0
        answers.append(json.loads(capsys.readouterr().out))
    assert answers[1]["layers"] >= answers[0]["layers"] and answers[1]["streaming"]


@pytest.mark.parametrize("argv,message", [
    (["--world-size", "2", "4", "--memory", "1GiB"], "--memory answers for one --world-size at a time"),
    (["--world-size", "2", "--grow", "n_layers"],
     "--grow, --streaming, --baseline, --json and --optimizer-state answer --memory"),
    (["--world-size", "2", "--memory", "lots"], "bad --memory 'lots'"),
    (["--world-size", "2", "--memory", "1KiB", "--grow", "n_layers", "--baseline", "0", *INPUT],
     "--memory 1KiB over 2 ranks: even the smallest model (1) needs"),
    # Without an input the activations counted as nothing: a 2-rank Llama answered 86 layers under 2 GiB
    # and peaked 17% over it.
    (["--world-size", "2", "--memory", "2GiB", "--grow", "n_layers", "--baseline", "0"],
     "--memory answers for a training step, whose activations depend on its input: give one rank's batch"),
    (["--world-size", "2", "--memory", "2GiB", "--baseline", "0"], "e.g. --input input_ids=int64[4,512]"),
    (["--world-size", "4", "--memory", "4GiB", "--shard-size", "2"], "--memory answers for ZeRO-3 over every "
                                                                      "data-parallel rank"),
    (["--world-size", "4", "--memory", "4GiB", "--tp-size", "2", "--pp-size", "2", *INPUT],
     "drop --shard-size, and --pp-size or --sequence-parallel beside --tp-size"),
    (["--world-size", "6", "--memory", "4GiB", "--tp-size", "4", "--baseline", "0", *INPUT],
     "--tp-size 4 must divide --world-size 6"),
    (["--world-size", "4", "--memory", "4GiB", "--pp-size", "2", "--optimizer-state", "disk", *INPUT],
     "--memory with --pp-size counts every stage's shards and optimizer state in memory"),
    # It answered as if the flag were absent: fp32 masters and bf16 gathers went uncounted.
    (["--world-size", "2", "--memory", "1GiB", "--baseline", "0", "--mixed-precision", "bf16"],
     "--memory does not count --mixed-precision"),
])
def test_plan_memory_errors(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["plan", f"{TOY}:ToyGPT", *argv]) == 2
    assert message in capsys.readouterr().err


def test_optimizer_on_disk_keeps_only_the_buffer_and_reads_the_state_each_step() -> None:
    plan, est = _plan(4)
    small, io = optimizer_on_disk(plan, est, 4096)
    assert io == est.optimizer > 4096 and small.optimizer == 4096
    assert small.total == est.total - est.optimizer + 4096
    assert replace(small, optimizer=est.optimizer, peak=est.peak) == est, "nothing but the optimizer state changes"
    assert small.peak == training_peak(plan, small) < est.peak
    # A buffer larger than any pass holds the largest pass: one flat buffer's shard of fp32 moments.
    largest = max(b.shard_numel(2) * 8 for g in plan.groups for b in g.buffers if b.requires_grad)
    assert optimizer_on_disk(plan, est, 2**40)[0].optimizer == largest < est.optimizer


def test_plan_memory_with_optimizer_state_on_disk(capsys: pytest.CaptureFixture[str]) -> None:
    baseline = 50 * MIB
    limit = str(2 * _peak(6, baseline) + 1)  # exactly 6 layers fit with the state in memory
    answers = []
    for extra in ([], ["--optimizer-state", "disk", "--optimizer-chunk", "4KiB"]):
        assert main(["plan", f"{TOY}:ToyGPT", "--world-size", "2", "--memory", limit, "--grow", "n_layers",
                     "--baseline", str(baseline), "--json", *INPUT, *extra]) == 0
        answers.append(json.loads(capsys.readouterr().out))
    memory, disk = answers
    assert memory["optimizer_state"] == "memory" and memory["disk_read_per_step"] is None
    assert disk["optimizer_state"] == "disk" and disk["layers"] > memory["layers"] == 6
    plan, est = _plan(disk["layers"], inputs=True)
    assert disk["disk_read_per_step"] == disk["disk_written_per_step"] == est.optimizer
    expected = process_peak(plan, optimizer_on_disk(plan, est, 4096)[0], baseline, margin_fraction=MARGIN).total
    assert disk["peak_per_rank"] == expected <= int(limit) // 2
    assert main(["plan", f"{TOY}:ToyGPT", "--world-size", "2", "--memory", "1GiB", "--baseline", "100MiB",
                 "--optimizer-state", "disk", *INPUT]) == 0
    assert "optimizer state on disk:" in capsys.readouterr().out


def test_cli_chunk_default_is_the_optimizers(capsys: pytest.CaptureFixture[str]) -> None:
    from bmt_wrap.cli import DISK_CHUNK_DEFAULT, parse_bytes
    from bmt_wrap.optim.adam_disk import DEFAULT_CHUNK_BYTES

    assert parse_bytes(DISK_CHUNK_DEFAULT) == DEFAULT_CHUNK_BYTES
    assert main(["plan", f"{TOY}:ToyGPT", "--world-size", "2", "--memory", "1GiB",
                 "--optimizer-chunk", "1MiB", *INPUT]) == 2
    assert "add --optimizer-state disk" in capsys.readouterr().err


_LIBRARY_FACTORY = '''
import torch

def build(n_layers: int = 2, heavy: bool = True) -> torch.nn.Module:
    if heavy:
        import {lib}  # a model library imported inside the factory, as transformers' models are
    return torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(n_layers)))

def light(n_layers: int = 2) -> torch.nn.Module:
    return build(n_layers, heavy=False)
'''


def test_the_baseline_counts_the_model_library_the_factory_imports(tmp_path: Path) -> None:
    """A rank imports its model library before it trains: the measured baseline must include it."""
    import subprocess
    import sys

    (tmp_path / "heavy_lib.py").write_text("BLOB = b'x' * (96 << 20)  # resident on import\n")
    (tmp_path / "factory.py").write_text(_LIBRARY_FACTORY.format(lib="heavy_lib"))
    baselines = {}
    for name in ("build", "light"):
        out = subprocess.run([sys.executable, "-c", "import sys; from bmt_wrap.cli import main; sys.exit(main())",
                              "plan", f"{tmp_path / 'factory.py'}:{name}", "--world-size", "2", "--memory", "8GiB",
                              "--json", "--input", "float32[2,64]"], capture_output=True, text=True,
                             env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
        assert out.returncode == 0, out.stderr
        baselines[name] = json.loads(out.stdout)["baseline"]
    assert baselines["build"] - baselines["light"] >= 90 * MIB, baselines


# ---- offload="disk": only the shards in flight count ----------------------------------------------------
def _offload_plan(n_layers: int, world_size: int = 2):
    from toy import ToyGPT

    with torch.device("meta"):
        model = ToyGPT(n_layers=n_layers)
    discovery = discover_blocks(model)
    plan = build_plan(model, discovery, world_size=world_size, capture=capture(model, discovery, None),
                      offload="disk")
    return plan, plan.estimates[str(world_size)]


def test_offload_counts_only_the_shards_in_flight() -> None:
    from bmt_wrap.base.plan import WrapPlan

    _, est = _plan(8)
    plan, off = _offload_plan(8)
    shard = {g.name: sum(b.shard_numel(2) * torch.empty(0, dtype=getattr(torch, b.dtype)).element_size()
                         for b in g.buffers) for g in plan.groups}
    block = max(shard[g.name] for g in plan.blocks())
    root = max(shard[g.name] for g in plan.groups if g.is_root)
    depth = plan.prefetch_depth
    assert plan.offload == "disk"
    # the blocks' shards the gathers and the read-ahead hold, or the root's with one block fewer
    assert off.params == min(est.params, max((depth + 2) * block, root + (depth + 1) * block)) < est.params
    assert off.grads < est.grads and off.no_sync_grads == 0
    # every shard read for forward's and backward's gathers and the optimizer, which reads the gradients too
    assert off.disk_read == 3 * est.params + est.grads and off.disk_written == est.params + est.grads
    assert replace(off, params=est.params, grads=est.grads, no_sync_grads=est.no_sync_grads, disk_read=None,
                   disk_written=None, peak=est.peak) == est, "nothing else changes (the peak counts the terms)"
    again = WrapPlan.from_json(plan.to_json())
    assert again.offload == "disk" and again.estimates == plan.estimates
    # the per-layer cost left is the gathered blocks' and activations': the more layers, the larger the gap
    assert _offload_plan(32)[1].params == off.params


def test_offload_counts_the_first_block_backward_beside_every_kept_activation() -> None:
    """Offloaded gradient shards go to the file as they arrive, so the blocks' backward peaks at its start:
    the first block's backward beside every activation the forward kept (measured on the capacity GPT: the
    peak grew with the layers by their checkpointed inputs; the count without this phase did not grow)."""
    import models as M

    phases = {}
    for n_layers in (4, 12):
        for offload in (None, "disk"):
            model = M.ToyGPT(n_layers=n_layers, tie=True)
            inputs = ((M.token_ids(),), {})
            discovery = discover_blocks(model)
            plan = build_plan(model, discovery, world_size=2, capture=capture(model, discovery, inputs),
                              offload=offload)
            est = plan.estimates["2"]
            phases[n_layers, offload] = training_phases(plan, est)
            assert est.activations and est.activations_recompute, "the profile measured them"
            # what backward's start holds (every kept activation) and the first block's backward: one
            # block's gradient shard in flight (a tied head has no early shard), its gradient, its recompute
            block = max(sum(b.shard_numel(2) * 4 for b in g.buffers) for g in plan.blocks())
            assert phases[n_layers, offload]["blocks' backward start"] == (
                phases[n_layers, offload]["backward start"] + min(est.grads, block) + est.grads_in_flight
                + est.activations_recompute)
            if offload is None:  # in memory the shards pile up: the end is higher
                assert max(phases[n_layers, offload], key=phases[n_layers, offload].get) != "blocks' backward start"
    kept_more = (phases[12, "disk"]["backward start"] - phases[4, "disk"]["backward start"])
    assert kept_more > 0
    assert (phases[12, "disk"]["blocks' backward start"] - phases[4, "disk"]["blocks' backward start"]
            == kept_more), "only the kept activations grow with the layers"


def _meta_plan(offload: str | None, d: int, n_layers: int = 4, world_size: int = 2):
    from toy import ToyGPT

    with torch.device("meta"):
        model = ToyGPT(d=d, n_layers=n_layers)
    discovery = discover_blocks(model)
    plan = build_plan(model, discovery, world_size=world_size, capture=capture(model, discovery, None),
                      offload=offload)
    return plan, plan.estimates[str(world_size)]


@pytest.mark.parametrize("d", [16, 1024])
def test_host_offload_counts_the_device_like_disk(d: int) -> None:
    """offload="host" counts the device: the shards and gradient shards in flight as offload="disk" counts
    memory, one chunk of each of AdamOptimizer's state tensors (the rest is on the host), and the bytes copied
    each way per step instead of file traffic."""
    from bmt_wrap.base.plan import HOST_STEP_CHUNK_ELEMS, WrapPlan

    _, plain = _meta_plan(None, d)
    _, disk = _meta_plan("disk", d)
    plan, host = _meta_plan("host", d)
    assert plan.offload == "host"
    assert (host.params, host.grads, host.no_sync_grads) == (disk.params, disk.grads, 0)
    # fp32 shards: Adam's two moments, a chunk of each on the device; a small model's whole state is less
    assert host.optimizer == min(plain.optimizer, HOST_STEP_CHUNK_ELEMS * 8)
    if d == 1024:
        assert host.optimizer < plain.optimizer, "a large model's state is more than one chunk"
    assert host.host_to_device == disk.disk_read + plain.optimizer
    assert host.device_to_host == disk.disk_written + plain.optimizer
    assert host.disk_read is None and disk.host_to_device is None
    assert replace(host, optimizer=disk.optimizer, host_to_device=None, device_to_host=None,
                   disk_read=disk.disk_read, disk_written=disk.disk_written, peak=disk.peak) == disk, \
        "nothing else differs (the peak counts the terms)"
    assert WrapPlan.from_json(plan.to_json()).estimates == plan.estimates


def test_host_offload_counts_the_first_block_backward() -> None:
    import models as M

    model = M.ToyGPT(n_layers=4, tie=True)
    discovery = discover_blocks(model)
    captured = capture(model, discovery, ((M.token_ids(),), {}))
    phases = {}
    for offload in ("disk", "host"):
        plan = build_plan(model, discovery, world_size=2, capture=captured, offload=offload)
        est = plan.estimates["2"]
        phases[offload] = training_phases(plan, est)
        block = max(sum(b.shard_numel(2) * 4 for b in g.buffers) for g in plan.blocks())
        assert phases[offload]["blocks' backward start"] == (
            phases[offload]["backward start"] + min(est.grads, block) + est.grads_in_flight
            + est.activations_recompute)
    # the same phases, less what the device holds of the optimizer (the toy's whole state: one chunk)
    assert phases["host"] == phases["disk"]


def test_plan_cli_offload_host(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", f"{TOY}:ToyGPT", "--world-size", "2", "4", "--offload", "host"]) == 0
    out = capsys.readouterr().out
    assert "host -> device / step" in out and "device -> host / step" in out
    assert "offload file" not in out
    assert main(["plan", f"{TOY}:ToyGPT", "--world-size", "2", "--offload", "host", "--memory", "8GiB"]) == 2
    assert "--memory answers for a CPU process" in capsys.readouterr().err


def test_plan_cli_offload_disk(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", f"{TOY}:ToyGPT", "--world-size", "2", "4", "--offload", "disk"]) == 0
    out = capsys.readouterr().out
    assert "offload file: read / step" in out and "offload file: written / step" in out
    baseline = 50 * MIB
    limit = str(2 * _peak(6, baseline) + 1)  # exactly 6 layers fit in memory
    answers = []
    for extra in ([], ["--offload", "disk"], ["--offload", "disk", "--streaming"]):
        assert main(["plan", f"{TOY}:ToyGPT", "--world-size", "2", "--memory", limit, "--grow", "n_layers",
                     "--baseline", str(baseline), "--json", *INPUT, *extra]) == 0
        answers.append(json.loads(capsys.readouterr().out))
    memory, disk, streamed = answers
    assert memory["layers"] == 6 and memory["offload"] is None and memory["shards_read_per_step"] is None
    assert streamed["layers"] >= disk["layers"] > memory["layers"], answers
    plan, est = _plan(disk["layers"], offload="disk", inputs=True)
    assert disk["peak_per_rank"] == process_peak(plan, est, baseline, margin_fraction=MARGIN).total <= int(limit) // 2
    assert (disk["shards_read_per_step"], disk["shards_written_per_step"]) == (est.disk_read, est.disk_written)


# ---- moving more off the process never counts more ------------------------------------------------------
_MOVES = {"offload": (None, "disk"), "optimizer_state": ("memory", "disk"), "built_full": (True, False)}


def _peaks_by_placement(model: torch.nn.Module, batch: int, world_size: int) -> dict[tuple, tuple[dict, int]]:
    """Every placement's training phases and process peak (100 MiB baseline): shards in memory or offloaded
    to disk, Adam's state in memory or on disk, the model built whole or streamed."""
    import models as M

    from bmt_wrap.passes.fused_loss import fused_loss_section, with_fused_loss

    ids = torch.empty(batch, M.SEQ, dtype=torch.int64, device="meta")
    discovery = discover_blocks(model)
    captured = capture(model, discovery, ((ids, ids), {}))
    captured = with_fused_loss(captured, fused_loss_section(model, captured, enabled=False))
    found = {}
    for offload in _MOVES["offload"]:
        plan = build_plan(model, discovery, world_size=world_size, capture=captured, offload=offload)
        est = plan.estimates[str(world_size)]
        for state in _MOVES["optimizer_state"]:
            moved = optimizer_on_disk(plan, est, 32 * MIB)[0] if state == "disk" else est
            for built_full in _MOVES["built_full"]:
                peak = process_peak(plan, moved, 100 * MIB, built_full=built_full, margin_fraction=MARGIN).total
                found[offload, state, built_full] = (training_phases(plan, moved), peak)
    return found


def _assert_more_off_counts_no_more(found: dict[tuple, tuple[dict, int]]) -> None:
    for key, (phases, peak) in found.items():
        for axis, (less, more) in enumerate(_MOVES.values()):
            if key[axis] != less:
                continue
            moved = key[:axis] + (more,) + key[axis + 1:]
            more_phases, more_peak = found[moved]
            assert more_peak <= peak, (key, moved, peak, more_peak)
            assert max(more_phases.values()) <= max(phases.values()), (key, moved, phases, more_phases)
            for name in phases.keys() & more_phases.keys():
                assert more_phases[name] <= phases[name], (key, moved, name, phases, more_phases)


def test_offloading_a_large_root_counts_no_more_than_keeping_it() -> None:
    """The root's gradient shard is written after its gradient is gone, offloaded or not: with the shards on
    disk the count kept it beside the root's gradient as a shard in flight (where the root's shard is the
    largest), so GPT-2 of width 768 (vocabulary 50,257) built whole over 2 ranks under 3 GiB was answered 1
    layer with --offload disk and 2 without."""
    import models as M

    with torch.device("meta"):
        model = M.ToyGPT(n_layers=2, dim=64, vocab=8192, tie=True)
    _assert_more_off_counts_no_more(_peaks_by_placement(model, batch=1, world_size=2))


@settings(max_examples=12, deadline=None)
@given(layers=st.integers(1, 5), dim=st.sampled_from([16, 48, 64]), vocab=st.sampled_from([64, 1000, 8192]),
       tie=st.booleans(), batch=st.integers(1, 4), world_size=st.integers(2, 4))
def test_moving_more_off_the_process_never_counts_more(layers: int, dim: int, vocab: int, tie: bool, batch: int,
                                                        world_size: int) -> None:
    """Shards offloaded, Adam's state on disk, the model streamed instead of built whole: each, alone or
    added to the others, leaves every phase and the peak no higher, so ``--grow`` never answers fewer."""
    import models as M

    with torch.device("meta"):
        model = M.ToyGPT(n_layers=layers, dim=dim, vocab=vocab, tie=tie)
    _assert_more_off_counts_no_more(_peaks_by_placement(model, batch, world_size))


# ---- pipeline stages (--pp-size) -------------------------------------------------------------------------------
MODELS = str(Path(__file__).with_name("models.py"))


def _stage_plan(n_layers: int, world_size: int = 4, stages: int = 2, micro: int = 2):
    """models.ToyGPT's plan over ``stages`` pipeline stages, as ``plan --pp-size`` makes it, with its stages'
    estimates for ``INPUT``'s batch."""
    from models import ToyGPT

    with torch.device("meta"):
        model = ToyGPT(n_layers=n_layers)
    discovery = discover_blocks(model)
    ids, targets = (torch.empty(2, 16, dtype=torch.int64, device="meta") for _ in range(2))  # as INPUT's two
    captured = capture(model, discovery, ((ids, targets), {}))
    dp = world_size // stages
    plan = build_plan(model, discovery, world_size=dp, capture=captured)
    plan.pipeline = plan_pipeline(model, plan, stages, micro, captured.graph)
    return model, plan, estimate_pipeline(plan, plan.pipeline, dp, captured.activations)


def test_plan_memory_counts_pipeline_stages(capsys: pytest.CaptureFixture[str]) -> None:
    """``plan --memory --pp-size``: the worst stage's shards, its blocks held for the step with their summed
    gradients, its root parameters and the activations the schedule holds (GPipe: every micro-batch's
    boundary activations; 1F1B: min(M, P - stage) of them), beside the baseline, with the 4% margin."""
    from models import DIM

    baseline, world, stages, micro, batch, seq = 100 * MIB, 4, 2, 2, 2, 16
    dp = world // stages
    model, plan, estimates = _stage_plan(4, world, stages, micro)
    numel = {n: p.numel() for n, p in model.named_parameters()}
    expected: dict[str, list[float]] = {"GPipe": [], "1F1B": []}
    for s, (stage, est) in enumerate(zip(plan.pipeline.stages, estimates, strict=True)):
        blocks = sum(n for name, n in numel.items() if any(name.startswith(b + ".") for b in stage.blocks))
        root = sum(numel[name] for name in stage.root)
        fixed = (4 * 4 * (blocks + root) / dp  # fp32 parameter, gradient and AdamW's two moments, sharded
                 + 2 * 4 * blocks  # the stage's blocks gathered for the step, and their summed gradients
                 + 4 * root)  # its root parameters gathered
        boundary = 4 * (batch // micro) * seq * DIM if s > 0 else 0  # one micro-batch's hidden states
        kept = est.zero.activations  # the whole local batch's activations of the stage (the capture's profile)
        in_flight = min(micro, stages - s)
        expected["GPipe"].append(fixed + kept + micro * boundary)
        expected["1F1B"].append(fixed + kept * in_flight / micro + in_flight * boundary)
    for schedule, values in expected.items():
        assert [e.peak(schedule) for e in estimates] == pytest.approx(values, rel=0.01), schedule
    assert estimates[1].peak("1F1B") < estimates[1].peak("GPipe")  # the last stage holds one micro-batch

    argv = ["plan", f"{MODELS}:ToyGPT", "--world-size", str(world), "--pp-size", str(stages), "--microbatches",
            str(micro), "--memory", "1GiB", "--baseline", str(baseline), "--streaming", *INPUT]
    assert main([*argv, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    worst = max(expected["GPipe"])
    assert answer["peak_per_rank"] == pytest.approx((baseline + worst) * (1 + MARGIN), rel=1e-4)
    assert answer["training_phases"] == {f"stage {e.stage}": e.peak("GPipe") for e in estimates}
    assert answer["margin"] == round(answer["counted_per_rank"] * MARGIN) > 0 and answer["pp_size"] == stages
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"on stage {expected['GPipe'].index(worst)}" in out and "under 1F1B" in out

    # --grow answers the largest layer count whose worst stage fits
    def peak(k: int) -> int:
        _, p, e = _stage_plan(k, world, stages, micro)
        return pipeline_peak(p, e, baseline, margin_fraction=MARGIN)[1].total

    limit = world * peak(6) + 1
    assert main(["plan", f"{MODELS}:ToyGPT", "--world-size", str(world), "--pp-size", str(stages), "--memory",
                 str(limit), "--grow", "n_layers", "--baseline", str(baseline), "--json", *INPUT]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["layers"] == 6 and answer["peak_per_rank"] == peak(6) and peak(7) > limit // world
