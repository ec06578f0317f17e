"""``model.pipeline_step(..., schedule=...)``: torch.distributed.pipelining's schedules run one whole step of
a model wrapped with ``pp_size=P`` (and ``pp_virtual_stages=V``: P x V stages, V per rank) and train like
plain PyTorch in one process, as the GPipe loop does; schedules not offered, bad V, and calls without
pipeline stages, are named errors.
"""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable

import models
import pytest
import torch
from dist_harness import COMM_TIMEOUT, run_distributed
from parity import LOSS_RTOL, lm_batches, train_side_by_side

import bmt_wrap as bmt
from bmt_wrap import passes
from bmt_wrap.errors import PipelineError, PipelineScheduleError
from bmt_wrap.passes.pipeline import plan_pipeline
from bmt_wrap.runtime.block_executor import BlockCall
from bmt_wrap.runtime.pipeline import action_times


def test_virtual_stages_are_placed_round_the_ranks() -> None:
    # pure: the plan's section at pp_size=2, pp_virtual_stages=2 (no process group)
    model = models.ToyGPT(n_layers=4, tie=True)
    discovery = passes.discover_blocks(model)
    cap = passes.capture(model, discovery)
    plan = passes.build_plan(model, discovery, world_size=1, capture=cap)
    section = plan_pipeline(model, plan, 2, 4, cap.graph, virtual=2)
    assert [s.blocks for s in section.stages] == [["layers.0"], ["layers.1"], ["layers.2"], ["layers.3"]]
    assert [section.rank_of(s) for s in range(4)] == [0, 1, 0, 1] and section.stages_on(1) == [1, 3]
    assert section.rank_of_block("layers.2") == 0
    # the tied weight: used by stage 0 (rank 0) and stage 3 (rank 1), so both ranks hold it
    assert section.stages[3].root == ["embed.weight", "ln_f.weight", "ln_f.bias"]
    assert section.root_sets()[-1] == ((0, 1), ["embed.weight"])
    assert section.bubble() == pytest.approx(1 / (2 * 4 + 1))  # (P-1)/(V x M+P-1)
    plan.pipeline = section
    again = type(plan).from_json(plan.to_json())
    assert again.pipeline == section and "pipeline: 2 ranks x 2 stages, 4 micro-batches" in str(again)
    with pytest.raises(PipelineError, match="for 6 pipeline stages"):
        plan_pipeline(model, plan, 2, 4, cap.graph, virtual=3)
    with pytest.raises(PipelineError, match="pp_virtual_stages=True"):
        plan_pipeline(model, plan, 2, 4, cap.graph, virtual=True)


def _llama_labels(ids):
    labels = ids.clone()
    labels[:, :3] = -100  # ignored tokens: the micro-batches' losses must still sum to the batch's mean
    return labels


def _train(kind: str, schedule: str, micro: int, optimizer: str = "adamw", virtual: int = 1,
           layers: int = 4, after_step: Callable[[], None] | None = None) -> list[float]:
    """3 steps of ``pipeline_step`` side by side with plain PyTorch (grads each step, parameters at the end:
    checked inside); ``virtual``: stages per rank; ``layers``: the toy GPT's blocks; ``after_step``: called
    when each of the toy's steps has returned."""
    if kind == "llama":
        build = models.llama
        batches = [(b[0],) for b in lm_batches(3, 8, seq=8, vocab=models.VOCAB)]
        def loss_fn(m, ids):
            return m(input_ids=ids, labels=_llama_labels(ids)).loss

        def step_fn(m, ids):
            return m.pipeline_step(input_ids=ids, labels=_llama_labels(ids), schedule=schedule)
    else:
        def build():
            return models.ToyGPT(n_layers=layers, tie=kind == "tied")
        batches, loss_fn = lm_batches(3, 8, seq=8, vocab=models.VOCAB), None

        def step_fn(m, ids, targets):
            if schedule == "loop":  # the loop users write: model(...), loss.backward()
                loss = m(ids, targets)
                loss.backward()
                loss = loss.detach()
            else:
                loss = m.pipeline_step(ids, targets, schedule=schedule)
            if after_step is not None:
                after_step()
            return loss
    def wrap(m):
        return bmt.BMTrainModelWrapper(m, pp_microbatches=micro, pp_virtual_stages=virtual)
    result = train_side_by_side(build, wrap, batches,
                                optimizer=optimizer, loss_fn=loss_fn, step_fn=step_fn,
                                data_parallel=(bmt.data_parallel_rank(), bmt.data_parallel_size()))
    gc.collect()  # the wrapped model goes before the next one takes the engine
    return result["losses"]


def _raises(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "", ""


def _virtual_readers(tmp: str) -> dict:
    """A model with two stages per rank (rank 0: layers 0 and 2, rank 1: layers 1 and 3): its readers give
    whole tensors under the original names, and its checkpoint resumes at one stage per rank."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    ref = models.ToyGPT(n_layers=4, tie=True)
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref), pp_virtual_stages=2)
    out = {"stages": [s.blocks for s in model.plan.pipeline.stages], "mine": model._bmt_pipeline.mine}
    want = ref.state_dict()
    state = model.state_dict()
    out["state_dict"] = list(state) == list(want) and all(torch.equal(state[k], v) for k, v in want.items())
    bmt.save(model, f"{tmp}/model.safetensors")
    saved = load_file(f"{tmp}/model.safetensors")
    out["save"] = sorted(saved) == sorted(want) and all(torch.equal(saved[k], v) for k, v in want.items())
    bmt.save_checkpoint(f"{tmp}/ckpt", model, optimizer=torch.optim.AdamW(model.parameters()), step=1)
    torch.manual_seed(5)  # another init: everything must come from the checkpoint
    other = bmt.BMTrainModelWrapper(models.ToyGPT(n_layers=4, tie=True))
    bmt.load_checkpoint(f"{tmp}/ckpt", other, optimizer=torch.optim.AdamW(other.parameters()))
    out["resumed"] = all(torch.equal(other.state_dict()[k], v) for k, v in want.items())
    del model, other
    gc.collect()
    return out


class _Recomputes:
    """While entered, a weak reference to every tensor a block call's recompute makes."""

    def __enter__(self) -> _Recomputes:
        self.refs: list[weakref.ref] = []
        self.recompute = BlockCall._recompute

        def watched(call: BlockCall) -> None:
            self.recompute(call)
            self.refs.extend(weakref.ref(t) for t in call.recomputed.values())
        BlockCall._recompute = watched
        return self

    def __exit__(self, *exc: object) -> None:
        BlockCall._recompute = self.recompute

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.refs)


def _pp2_body(tmp: str) -> dict:
    bmt.init_distributed(seed=0, backend="gloo", timeout=COMM_TIMEOUT, pipe_size=2)
    # the tied embedding and head: a weight on both stages, its gradients summed between them after the
    # schedule; torch's GPipe runs every forward before any backward, so several micro-batches' graphs read
    # the root's gathered parameters at once
    out = {"1F1B": _train("tied", "1F1B", 4), "GPipe": _train("tied", "GPipe", 4), "llama": _train("llama", "1F1B", 2)}
    # two stages per rank (4 stages of one block): torch's interleaved schedules (its zero-bubble one splits
    # each backward into the inputs' part and, later, the weights'), and the GPipe loop, which runs both of a
    # rank's stages in each micro-batch's forward
    for name in ("Interleaved1F1B", "LoopedBFS", "loop"):
        out[f"v2 {name}"] = _train("tied", name, 4, virtual=2)
    # what B kept of the recompute for W: alive, before any gc.collect(), once each step has returned; and the
    # actions the step ran, with their CPU seconds (benchmarks/pipeline.py replays them)
    alive: list[int] = []
    actions: list[list[tuple[str, int, int, float]]] = []
    with _Recomputes() as recomputes:
        out["v2 InterleavedZeroBubble"] = _train(
            "tied", "InterleavedZeroBubble", 4, virtual=2,
            after_step=lambda: (alive.append(recomputes.alive()), actions.append(action_times())))
    out["zb freed"] = {"recomputed": len(recomputes.refs), "alive": alive}
    out["zb actions"] = actions
    out["readers"] = _virtual_readers(tmp)
    model = bmt.BMTrainModelWrapper(models.ToyGPT(n_layers=4), pp_microbatches=2)
    ids, targets = lm_batches(1, 4, vocab=models.VOCAB)[0]
    out["unknown"] = _raises(lambda m=model: m.pipeline_step(ids, targets, schedule="2F2B"))
    out["zbv"] = _raises(lambda m=model: m.pipeline_step(ids, targets, schedule="ZBVZeroBubble"))
    out["no_loss"] = _raises(lambda m=model: m.pipeline_step(ids))
    del model
    gc.collect()
    # bad V: more stages than blocks, not a positive int; a one-stage schedule, and micro-batches torch's
    # interleaved rounds do not divide
    out["v3"] = _raises(lambda: bmt.BMTrainModelWrapper(models.ToyGPT(n_layers=4), pp_virtual_stages=3))
    out["v0"] = _raises(lambda: bmt.BMTrainModelWrapper(models.ToyGPT(n_layers=4), pp_virtual_stages=0))
    model = bmt.BMTrainModelWrapper(models.ToyGPT(n_layers=4), pp_microbatches=5, pp_virtual_stages=2)
    ids, targets = lm_batches(1, 10, vocab=models.VOCAB)[0]
    out["v2 1F1B"] = _raises(lambda m=model: m.pipeline_step(ids, targets, schedule="1F1B"))
    out["v2 rounds"] = _raises(lambda m=model: m.pipeline_step(ids, targets))
    del model
    gc.collect()
    bmt.init_distributed(seed=0, backend="gloo", timeout=COMM_TIMEOUT)  # no pipeline: ZeRO-3 over both ranks
    plain = bmt.BMTrainModelWrapper(models.ToyGPT(n_layers=4))
    out["no_stages"] = _raises(lambda m=plain: m.pipeline_step(ids, targets))
    del plain
    gc.collect()
    out["v2 no stages"] = _raises(lambda: bmt.BMTrainModelWrapper(models.ToyGPT(n_layers=4), pp_virtual_stages=2))
    return out


def test_schedules_train_like_plain_pytorch_at_pp2(tmp_path) -> None:
    results = run_distributed(_pp2_body, 2, str(tmp_path), timeout=600)  # several trainings on 2 shared cores
    for r in results:
        # 1F1B, torch's GPipe, its interleaved schedules and the GPipe loop at two stages per rank give the
        # same losses (each checked against plain PyTorch inside: losses, whole gradients every step,
        # parameters after 3 AdamW steps)
        for name in ("GPipe", "v2 Interleaved1F1B", "v2 LoopedBFS", "v2 InterleavedZeroBubble", "v2 loop"):
            assert r["1F1B"] == pytest.approx(r[name], rel=LOSS_RTOL), (name, r)
        # the recompute's tensors that B kept for W are gone once the step returns
        assert r["zb freed"]["recomputed"] > 0 and r["zb freed"]["alive"] == [0, 0, 0], r["zb freed"]
        # each step logged its own actions (the last step's only): a forward, an inputs' (I) and a weights' (W)
        # backward per micro-batch and stage of the rank, once each, with CPU seconds
        mine = r["readers"]["mine"]
        for step in r["zb actions"]:
            assert sorted(a[:3] for a in step) == sorted((k, s, m) for k in "FIW" for s in mine for m in range(4)), step
            assert all(a[3] >= 0 for a in step) and sum(a[3] for a in step) > 0, step
        readers = r["readers"]
        assert readers["stages"] == [["layers.0"], ["layers.1"], ["layers.2"], ["layers.3"]], readers
        assert readers["state_dict"] and readers["save"] and readers["resumed"], readers
        assert r["unknown"][0] == PipelineScheduleError.__name__ and "'1F1B'" in r["unknown"][1], r["unknown"]
        zbv = r["zbv"]  # its V-shaped placement is not the plan's
        assert zbv[0] == PipelineScheduleError.__name__ and "not offered" in zbv[1] and "2P-1-s" in zbv[1], zbv
        assert "'InterleavedZeroBubble'" in zbv[1], zbv
        assert r["no_loss"][0] == PipelineError.__name__ and "loss" in r["no_loss"][1], r["no_loss"]
        assert r["no_stages"][0] == PipelineError.__name__ and "pp_size=P" in r["no_stages"][1], r["no_stages"]
        # bad V, named on every rank
        assert r["v3"][0] == "PipelineError" and "6 pipeline stages" in r["v3"][1], r["v3"]
        assert "pp_virtual_stages=3" in r["v3"][1], r["v3"]
        assert r["v0"][0] == "PipelineError" and "pp_virtual_stages=0" in r["v0"][1], r["v0"]
        one = r["v2 1F1B"]
        assert one[0] == PipelineScheduleError.__name__ and "pp_virtual_stages=2" in one[1], one
        assert "'Interleaved1F1B'" in one[1], one
        assert r["v2 rounds"][0] == "PipelineError" and "pp_microbatches=5" in r["v2 rounds"][1], r["v2 rounds"]
        assert r["v2 no stages"][0] == "PipelineError" and "pp_size=" in r["v2 no stages"][1], r["v2 no stages"]
    assert [r["readers"]["mine"] for r in results] == [[0, 2], [1, 3]]
    trained = ("1F1B", "GPipe", "llama", "v2 Interleaved1F1B", "v2 LoopedBFS", "v2 InterleavedZeroBubble", "v2 loop")
    assert [results[0][k] for k in trained] == [results[1][k] for k in trained]  # every stage: the batch's loss


def _reduced_once(virtual: int, schedule: str | None) -> dict[str, list[str]]:
    """Each of this rank's blocks' collectives in one step of ``schedule``."""
    model = bmt.BMTrainModelWrapper(models.ToyGPT(n_layers=4), pp_microbatches=4, pp_virtual_stages=virtual)
    ids, targets = lm_batches(1, 8, seq=8, vocab=models.VOCAB)[0]
    n, r = bmt.data_parallel_size(), bmt.data_parallel_rank()
    model.pipeline_step(ids.chunk(n)[r], targets.chunk(n)[r], schedule=schedule)  # the first builds torch's stages
    with bmt.get_state().comm.trace() as ops:
        model.pipeline_step(ids.chunk(n)[r], targets.chunk(n)[r], schedule=schedule)
    section = model.plan.pipeline
    own = [b for s in model._bmt_pipeline.mine for b in section.stages[s].blocks]
    del model
    gc.collect()
    return {b: sorted(op for op, label, _ in ops if label == b) for b in own}


def _pp2_dp2_body() -> dict:
    bmt.init_distributed(seed=0, backend="gloo", timeout=COMM_TIMEOUT, pipe_size=2)
    out = {"toy": _train("toy", "1F1B", 4), "llama": _train("llama", "1F1B", 2),
           "v2": _train("toy", "Interleaved1F1B", 4, virtual=2)}
    # ZeRO-3 under 1F1B and interleaved 1F1B: a rank's blocks gathered once for the step and each stage's
    # reduced once, after that stage's last backward
    out["per_block"] = _reduced_once(1, None)
    out["per_block v2"] = _reduced_once(2, "Interleaved1F1B")
    out["per_block zb"] = _reduced_once(2, "InterleavedZeroBubble")  # reduced after each stage's last W
    bmt.init_distributed(seed=0, backend="gloo", timeout=COMM_TIMEOUT, pipe_size=4)
    out["pp4"] = _train("toy", "1F1B", 4)
    # four ranks of two stages each (8 stages of one block, width 32): rank r runs blocks r and r + 4
    out["pp4 v2"] = _train("tied", "Interleaved1F1B", 4, virtual=2, layers=8)
    # TP inside the stages: each stage's blocks split over its TP pair. The TP size goes to init_distributed
    # so that data_parallel_rank() gives TP peers the same slice (given to the wrapper alone, the slices were
    # taken for the layout without TP: stage 0 raised TPInputMismatchError inside the schedule and stage 1
    # waited in torch's receive for the 30 minutes torch gives a group made without a timeout).
    bmt.init_distributed(seed=0, backend="gloo", timeout=COMM_TIMEOUT, pipe_size=2, tp_size=2)
    out["pp2_tp2"] = _train("toy", "1F1B", 4)
    # torch's waits on the pipe group (the schedule's, which pass no timeout) time out with the job's
    pipe = bmt.parallel_layout().pp.process_group
    out["pipe_timeout"] = pipe._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    return out


def test_1f1b_and_interleaved_train_like_plain_pytorch_at_pp2_dp2_pp4_pp4v2_and_pp2_tp2_and_reduce_once() -> None:
    results = run_distributed(_pp2_dp2_body, 4, timeout=600)
    for r in results:
        for key, blocks in (("per_block", 2), ("per_block v2", 2), ("per_block zb", 2)):
            assert len(r[key]) == blocks and all(ops == ["all_gather", "reduce_scatter"]
                                                 for ops in r[key].values()), r[key]
        # interleaved 1F1B at two stages per rank gives the 1F1B results (both checked against plain PyTorch)
        assert r["v2"] == pytest.approx(r["toy"], rel=LOSS_RTOL), r
    # the same loss on both stages of a pipeline (rank = pp x 2 + dp: ranks 0 and 2 are one pipeline)
    for a, b in ((0, 2), (1, 3)):
        assert results[a]["toy"] == results[b]["toy"] and results[a]["llama"] == results[b]["llama"]
    assert all(r["pp4"] == results[0]["pp4"] for r in results)
    assert all(r["pp4 v2"] == results[0]["pp4 v2"] for r in results)  # parity checked inside
    assert all(r["pp2_tp2"] == results[0]["pp2_tp2"] for r in results)  # parity checked inside
    assert all(r["pipe_timeout"] == COMM_TIMEOUT.total_seconds() for r in results), [r["pipe_timeout"] for r in results]
