"""Pipeline parallelism in the one-liner: ``BMTrainModelWrapper(model, pp_size=P)`` trains like plain PyTorch
in one process, driven by the loop users write (``model(...)``, ``loss.backward()``, ``opt.step()`` on every
rank), each rank holding only its stage's share, and bad input fails every rank with a named error.
"""

from __future__ import annotations

import contextlib
import gc
import time
from datetime import timedelta

import models
import pytest
import torch
from dist_harness import COMM_TIMEOUT, run_distributed
from parity import lm_batches, train_side_by_side
from torch import nn
from torch.distributed.distributed_c10d import _set_pg_timeout

import bmt_wrap as bmt
from bmt_wrap import passes
from bmt_wrap.errors import InitError, ModelMismatchError, PipelineError, PlanError
from bmt_wrap.passes.pipeline import balanced_split, estimate_pipeline, plan_pipeline


def use_pipeline(pipe_size: int) -> None:
    """The job's layout as ``init_distributed(pipe_size=P)`` makes it (data slices follow it at once)."""
    bmt.init_distributed(seed=0, backend="gloo", timeout=COMM_TIMEOUT, pipe_size=pipe_size)


def _llama_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[:, :3] = -100  # ignored tokens: the micro-batches' losses must still sum to the batch's mean
    return model(input_ids=ids, labels=labels).loss


def _llama_loss_counted(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The loss as transformers' Trainer asks for it: with the batch's count of labelled tokens given."""
    labels = ids.clone()
    labels[:, :3] = -100
    return model(input_ids=ids, labels=labels, num_items_in_batch=int((labels[..., 1:] != -100).sum())).loss


def _llama4() -> nn.Module:
    """``models.llama()`` with 4 layers, one per stage at pp4."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return models.seeded(lambda: LlamaForCausalLM(LlamaConfig(**{**models._hf_small(), "num_hidden_layers": 4})))


def _train(kind: str, optimizer: str, wrap_kwargs: dict | None = None) -> dict:
    """One model trained side by side with plain PyTorch (3 steps); the test's own checks raise inside."""
    if kind in ("llama", "llama4", "llama counted"):
        build = _llama4 if kind == "llama4" else models.llama
        loss_fn = _llama_loss_counted if kind == "llama counted" else _llama_loss
        batches = [(b[0],) for b in lm_batches(3, 8, seq=8, vocab=models.VOCAB)]
        batches[1][0][0, -1] = 7  # another batch on the second step
    else:
        build, loss_fn = (lambda: models.ToyGPT(n_layers=4, tie=kind == "tied")), None
        batches = lm_batches(3, 8, seq=8, vocab=models.VOCAB)
    wrapped: list[nn.Module] = []
    result = train_side_by_side(build, lambda m: wrapped.append(bmt.BMTrainModelWrapper(m, **(wrap_kwargs or {})))
                                or wrapped[0], batches, optimizer=optimizer, loss_fn=loss_fn,
                                data_parallel=(bmt.data_parallel_rank(), bmt.data_parallel_size()))
    split = sum(getattr(p, "_tp_split_dim", None) is not None for p in wrapped.pop().parameters())
    gc.collect()  # the wrapped model goes before the next one takes the engine
    return {"losses": result["losses"], "ref": result["ref_losses"], "tp_split": split}


# ---- parity -------------------------------------------------------------------------------------------------
def _pp2_body() -> list[dict]:
    use_pipeline(2)
    return [_train("toy", "adamw"), _train("tied", "sgd", {"pp_microbatches": 4}), _train("llama", "adamw"),
            _train("llama counted", "sgd")]


def test_pp2_trains_like_plain_pytorch() -> None:
    # toy GPT (AdamW), its tied-embedding variant (the weight on both stages, gradients summed; SGD: parameters
    # elementwise), transformers' Llama with labels (AdamW), and given num_items_in_batch as the Trainer gives
    # it (its micro-batch losses already divide by the whole batch's count: they sum), all within DESIGN.md's
    # tolerances
    results = run_distributed(_pp2_body, 2)
    assert results[0] == results[1]  # both stages return the whole batch's loss


def _pp2_dp2_and_pp4_body() -> list[dict]:
    use_pipeline(2)
    out = [_train("toy", "adamw"), _train("llama", "adamw")]
    use_pipeline(4)
    out.append(_train("toy", "adamw", {"pp_size": 4}))  # the wrapper's keyword agrees with init_distributed's
    out.append(_train("llama4", "adamw"))
    return out


def test_pp2_dp2_and_pp4_train_like_plain_pytorch() -> None:
    results = run_distributed(_pp2_dp2_and_pp4_body, 4)
    assert all(r == results[0] for r in results)


def _pp2_tp2_body(tmp: str) -> dict:
    import copy

    from parity import LOSS_RTOL, compare_grads
    from safetensors.torch import load_file
    from test_tp_plan import TOY_PLAN

    bmt.init_distributed(seed=0, backend="gloo", timeout=COMM_TIMEOUT, pipe_size=2, tp_size=2)
    out = {"toy": _train("toy", "adamw", {"tp_plan": TOY_PLAN}), "llama": _train("llama", "adamw"),
           "tied": _train("tied", "sgd", {"tp_plan": TOY_PLAN, "pp_microbatches": 4})}
    # state_dict() and bmt.save: whole tensors (TP slices joined, other stages' from their holders); the
    # layout named by a ("pp", "dp", "tp") device mesh this time
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    ref = models.ToyGPT(n_layers=4)
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref), mesh=mesh, tp_plan=TOY_PLAN)
    state = model.state_dict()
    out["state_dict"] = list(state) == list(ref.state_dict()) and all(
        torch.equal(state[k], v) for k, v in ref.state_dict().items())
    bmt.save(model, f"{tmp}/model.safetensors")
    saved = load_file(f"{tmp}/model.safetensors")
    out["save"] = sorted(saved) == sorted(ref.state_dict()) and all(
        torch.equal(saved[k], v) for k, v in ref.state_dict().items())
    # clip_grad_norm_ over every stage and TP slice: the whole model's norm, and the clipped gradients
    ids, targets = lm_batches(1, 4, vocab=models.VOCAB)[0]
    model(ids, targets).backward()
    ref(ids, targets).backward()
    norm, ref_norm = (torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5) for m in (model, ref))
    torch.testing.assert_close(norm, ref_norm, rtol=LOSS_RTOL, atol=0)
    compare_grads(ref, model, "after clip_grad_norm_")
    out["norm"] = float(norm)
    # what this rank holds (parameters, gradients, AdamW's moments) against its stage's share per TP rank,
    # the figure bmt-wrap plan --pp-size 2 --tp-size 2 prints
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    z = estimate_pipeline(model.plan, model.plan.pipeline, 1)[model._bmt_pipeline.stage].zero
    out["held"] = (_held_bytes(model, opt), z.params + z.grads + z.optimizer)
    del model, opt
    gc.collect()
    # generate(): the reference's greedy tokens, the Llama's layers split over each stage's TP pair
    llama = models.llama()
    wrapped = bmt.BMTrainModelWrapper(copy.deepcopy(llama))
    prompt = models.token_ids(batch=2, seq=5)
    out["generate"] = torch.equal(llama.generate(prompt, max_new_tokens=4, do_sample=False),
                                  wrapped.generate(prompt, max_new_tokens=4, do_sample=False))
    return out


def test_pp2_tp2_trains_like_plain_pytorch_reads_whole_tensors_and_generates(tmp_path) -> None:
    # Each stage's TP pair splits its blocks (toy GPT: a user plan; Llama with labels: its own plan; the tied
    # toy: its shared embedding/head split by vocabulary rows on both end stages) and ZeRO-3 shards them;
    # losses, whole gradients and parameters after 3 AdamW (tied: SGD) steps equal plain PyTorch.
    results = run_distributed(_pp2_tp2_body, 4, str(tmp_path))
    for r in results:
        assert r["state_dict"] and r["save"] and r["generate"], r
        held, share = r["held"]
        assert 0.97 * share <= held <= 1.05 * share, r["held"]
        assert all(r[k]["tp_split"] > 0 for k in ("toy", "llama", "tied")), r  # TP did split each model
        assert all(r[k] == results[0][k] for k in ("toy", "llama", "tied", "norm"))


# ---- what each rank holds --------------------------------------------------------------------------------
def _held_body() -> dict:
    use_pipeline(2)
    torch.manual_seed(0)
    model = bmt.BMTrainModelWrapper(models.ToyGPT(n_layers=4, dim=64), pp_microbatches=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, targets = lm_batches(1, 4, seq=8, vocab=models.VOCAB)[0]
    n, r = bmt.data_parallel_size(), bmt.data_parallel_rank()
    with bmt.get_state().comm.trace() as ops:
        loss = model(ids.chunk(n)[r], targets.chunk(n)[r])
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    own = model.plan.pipeline.stages[model._bmt_pipeline.stage].blocks
    # A stage's blocks are gathered once for the step and their gradients reduced once, whatever M is.
    per_block = {b: sorted(op for op, label, _ in ops if label == b) for b in own}
    stage = model.plan.pipeline.stages[model._bmt_pipeline.stage]
    return {"held": _held_bytes(model, opt), "share": 4 * stage.param_bytes / n,  # params, grads, two moments
            "names": [name for name, _ in model.named_parameters()],
            "shapes": [tuple(p.shape) for p in model.parameters()], "loss": float(loss), "per_block": per_block}


def test_each_rank_holds_its_stages_share_and_every_parameter_looks_whole() -> None:
    results = run_distributed(_held_body, 4)
    plain = models.ToyGPT(n_layers=4, dim=64)
    for r in results:
        assert r["held"] <= 1.05 * r["share"], r
        assert r["names"] == [n for n, _ in plain.named_parameters()]
        assert r["shapes"] == [tuple(p.shape) for p in plain.parameters()]
        assert all(ops == ["all_gather", "reduce_scatter"] for ops in r["per_block"].values()), r["per_block"]
    assert len({r["loss"] for r in results}) == 2  # one loss per data-parallel slice, the same on both stages


def _held_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """An independent count: the bytes of the storages every parameter, gradient and optimizer state views."""
    storages: dict[int, int] = {}
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.numel():
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


# ---- bad input fails every rank, named, at once ------------------------------------------------------------
class _BackwardBoom(torch.autograd.Function):
    """The identity, whose backward raises: a stage's backward failing (in its own code, as a user's does)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"backward boom on rank {bmt.rank()}")


class _ExplodingBlock(models.Block):
    explode = False
    explode_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.explode:
            raise ValueError(f"boom on rank {bmt.rank()}")
        out = super().forward(x)
        return _BackwardBoom.apply(out) if self.explode_backward else out


def _exploding() -> nn.Module:
    model = models.ToyGPT(n_layers=4)
    model.layers = nn.ModuleList(_ExplodingBlock() for _ in range(4))
    return model


@contextlib.contextmanager
def _short_timeouts(seconds: float):
    """The job's waits, ours and torch's schedules' on the pipe group, time out after ``seconds``: a rank left
    waiting for a failed one fails fast, not after the job's timeout."""
    comm, pipe = bmt.get_state().comm, bmt.parallel_layout().pp.process_group
    before = comm.timeout
    comm.timeout = timedelta(seconds=seconds)
    _set_pg_timeout(comm.timeout, pipe)
    try:
        yield
    finally:
        comm.timeout = before
        _set_pg_timeout(before, pipe)


def _raises(fn) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "", "", time.monotonic() - start


def _errors_body() -> dict:
    ids, targets = lm_batches(1, 4, seq=8, vocab=models.VOCAB)[0]
    out = {"world": _raises(lambda: bmt.BMTrainModelWrapper(models.ToyGPT(n_layers=4), pp_size=3)),
           "blocks": _raises(lambda: bmt.BMTrainModelWrapper(models.ToyGPT(n_layers=3), pp_size=4))}
    gc.collect()
    use_pipeline(2)
    model = bmt.BMTrainModelWrapper(models.ToyGPT(n_layers=4), pp_microbatches=2)
    out["batch"] = _raises(lambda: model(ids[:3], targets[:3]))
    gc.collect()
    torch.manual_seed(0)
    exploding = bmt.BMTrainModelWrapper(_exploding())
    # A block of the last stage raises (on both of its data-parallel ranks, as a stage's own code does: a
    # rank failing alone leaves its data-parallel peers in their next ZeRO gather until the timeout, as
    # without pipelines); stage 0 is sending it micro-batches.
    exploding.layers[3].explode = bmt.config["pipe_rank"] == 1
    n, r = bmt.data_parallel_size(), bmt.data_parallel_rank()
    out["stage"] = _raises(lambda m=exploding: m(ids.chunk(n)[r], targets.chunk(n)[r]))
    # The same under torch's 1F1B (model.pipeline_step): the last stage raising leaves stage 0 expecting its
    # gradients, the first stage raising leaves stage 1 expecting its activations.
    local = ids.chunk(n)[r], targets.chunk(n)[r]
    out["step_last"] = _raises(lambda m=exploding: m.pipeline_step(*local))
    exploding.layers[3].explode = False
    exploding.layers[0].explode = bmt.config["pipe_rank"] == 0
    out["step_first"] = _raises(lambda m=exploding: m.pipeline_step(*local))
    exploding.layers[0].explode = False
    # A backward that raises under torch's 1F1B (the last stage's: stage 0 waits for its gradients; the
    # first stage's: stage 1 waits for its next activations), named on every rank within seconds, not the
    # timeout (15 s here, so that a rank left waiting fails fast).
    with _short_timeouts(15):
        exploding.layers[3].explode_backward = bmt.config["pipe_rank"] == 1
        out["bwd_last"] = _raises(lambda m=exploding: m.pipeline_step(*local))
        exploding.layers[3].explode_backward = False
        exploding.layers[0].explode_backward = bmt.config["pipe_rank"] == 0
        out["bwd_first"] = _raises(lambda m=exploding: m.pipeline_step(*local))
    exploding.layers[0].explode_backward = False
    # A failed step leaves nothing behind (no transfer left pending between the stages, no partial sums):
    # the next step's gradients are those of a step on its own.
    # as a step that raised out of torch's schedule (a timeout) leaves it: the next step starts afresh
    exploding._bmt_pipeline.scheduled[1][0].submod.failure = RuntimeError("left over")
    exploding.zero_grad()
    exploding.pipeline_step(*local)
    after_failure = [p.grad.clone() for p in exploding.parameters() if p.grad is not None]
    exploding.zero_grad()
    exploding.pipeline_step(*local)
    alone = [p.grad.clone() for p in exploding.parameters() if p.grad is not None]
    out["clean_after"] = len(alone) > 0 and len(after_failure) == len(alone) and all(
        torch.equal(a, b) for a, b in zip(after_failure, alone, strict=True))
    del exploding
    gc.collect()
    out.update(_virtual_failures(local))
    depth = 4 if bmt.rank() < 2 else 5  # ranks that built different models
    out["models"] = _raises(lambda: bmt.BMTrainModelWrapper(models.ToyGPT(n_layers=depth)))
    return out


def _virtual_failures(local: tuple[torch.Tensor, ...]) -> dict:
    """Two stages per rank (rank 0 of the pipe: layers 0 and 2, rank 1: layers 1 and 3): a stage in the
    middle of the pipeline whose forward raises, in the GPipe loop and under Interleaved1F1B, and one whose
    backward raises, under Interleaved1F1B and InterleavedZeroBubble (in its inputs' pass); every rank names it."""
    torch.manual_seed(0)
    model = bmt.BMTrainModelWrapper(_exploding(), pp_virtual_stages=2)
    pipe_rank = bmt.config["pipe_rank"]
    out = {}
    with _short_timeouts(15):
        model.layers[2].explode = pipe_rank == 0  # stage 2: rank 0's second stage
        out["v2 loop"] = _raises(lambda m=model: m(*local))
        out["v2 step"] = _raises(lambda m=model: m.pipeline_step(*local))
        model.layers[2].explode = False
        model.layers[1].explode_backward = pipe_rank == 1  # stage 1: rank 1's first stage
        out["v2 bwd"] = _raises(lambda m=model: m.pipeline_step(*local))
        out["v2 zb bwd"] = _raises(lambda m=model: m.pipeline_step(*local, schedule="InterleavedZeroBubble"))
        model.layers[1].explode_backward = False
    del model
    gc.collect()
    return out


def test_bad_input_fails_every_rank_with_a_named_error_at_once() -> None:
    results = run_distributed(_errors_body, 4)
    for rank, r in enumerate(results):
        assert r["world"][0] == InitError.__name__ and "pp_size x tp_size" in r["world"][1], r["world"]
        assert r["blocks"][0] == PipelineError.__name__ and "3 block(s)" in r["blocks"][1], r["blocks"]
        assert r["batch"][0] == PipelineError.__name__ and "micro-batches" in r["batch"][1], r["batch"]
        name, message, seconds = r["stage"]
        if rank == 2:
            assert name == "ValueError" and "boom on rank 2" in message, r["stage"]
        else:  # every other rank stops and names it
            assert name == PipelineError.__name__ and "rank 2" in message and "boom" in message, r["stage"]
        for key, failing in (("step_last", 2), ("step_first", 0), ("bwd_last", 2), ("bwd_first", 0),
                             ("v2 loop", 0), ("v2 step", 0), ("v2 bwd", 2), ("v2 zb bwd", 2)):
            name, message, seconds = r[key]
            if rank == failing:
                assert name == "ValueError" and f"boom on rank {failing}" in message, r[key]
            else:  # every other rank stops at the step's end and names it
                assert name == PipelineError.__name__ and f"rank {failing}" in message and "boom" in message, r[key]
        assert r["clean_after"], "a step after a failed pipeline_step got other gradients than a step alone"
        assert r["models"][0] == ModelMismatchError.__name__, r["models"]
        assert all(r[k][2] < 30 for k in ("world", "blocks", "batch", "stage", "step_last", "step_first", "models")), r
        assert all(r[k][2] < 15 for k in ("bwd_last", "bwd_first", "v2 loop", "v2 step", "v2 bwd", "v2 zb bwd")), r


# ---- the plan's pipeline section (pure) ----------------------------------------------------------------------
def test_stages_are_balanced_contiguous_runs_of_blocks() -> None:
    assert balanced_split([1, 1, 1, 1], 2) == [2]
    assert balanced_split([4, 1, 1, 1, 1], 2) == [1]
    assert balanced_split([1, 1, 1, 1, 1, 1], 3) == [2, 4]
    model = models.ToyGPT(n_layers=4, tie=True)
    discovery = passes.discover_blocks(model)
    cap = passes.capture(model, discovery)
    plan = passes.build_plan(model, discovery, world_size=2, capture=cap)
    section = plan_pipeline(model, plan, 2, 4, cap.graph)
    assert [s.blocks for s in section.stages] == [["layers.0", "layers.1"], ["layers.2", "layers.3"]]
    assert section.stages[0].root == ["pos", "embed.weight"] and section.root_source == "graph"
    assert section.stages[1].root == ["embed.weight", "ln_f.weight", "ln_f.bias"]  # the tied head's weight
    assert section.root_sets()[-1] == ((0, 1), ["embed.weight"])
    assert section.bubble() == pytest.approx(1 / 5)
    plan.pipeline = section
    again = type(plan).from_json(plan.to_json())
    assert again.pipeline == section and "pipeline: 2 stages, 4 micro-batches" in str(again)
    # transformers' Llama is not fx-traceable: module order places its root parameters until the first call
    llama = models.llama()
    discovery = passes.discover_blocks(llama)
    plan = passes.build_plan(llama, discovery, world_size=1, capture=passes.capture(llama, discovery))
    section = plan_pipeline(llama, plan, 2, 2)
    assert section.root_source == "registration"
    assert section.stages[0].root == ["model.embed_tokens.weight"]
    assert section.stages[1].root == ["model.norm.weight", "lm_head.weight"]
    with pytest.raises(PipelineError, match="2 block"):
        plan_pipeline(llama, plan, 3, 2)
    with pytest.raises(PlanError, match="example_inputs="):
        wrong = plan_pipeline(llama, plan, 2, 2)
        wrong.stages[0].root, wrong.stages[1].root = wrong.stages[1].root, wrong.stages[0].root
        passes.check_root_order(wrong, passes.capture(llama, discovery, {"input_ids": models.token_ids(2)}).graph,
                                plan)


class _Repeat(nn.Module):
    """A block whose compute grows with ``times`` at the same parameters (one signature for every ``times``)."""

    def __init__(self, times: int) -> None:
        super().__init__()
        self.fc = nn.Linear(models.DIM, models.DIM)
        self.times = times

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.times):
            x = x + self.fc(x)
        return x


class _Uneven(nn.Module):
    """Six blocks of equal parameters; the last computes as much as five of the others."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Repeat(t) for t in (1, 1, 1, 1, 1, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.mean()


def test_stages_are_balanced_by_the_blocks_compute() -> None:
    from bmt_wrap.passes.activations import ActivationProfile, BlockCallActivations
    from bmt_wrap.passes.pipeline import block_costs

    model = _Uneven()
    discovery = passes.discover_blocks(model)
    cap = passes.capture(model, discovery, ((torch.randn(2, 8, models.DIM),), {}))
    plan = passes.build_plan(model, discovery, world_size=2, capture=cap)
    assert len(plan.blocks()) == 6 and cap.activations is not None
    # planned from inputs, the stages split the forward's FLOPs: 5 x 1 against 1 x 5 repeats (by parameter
    # bytes it was 3 blocks each: 3 against 7 repeats, the second stage pacing the pipeline)
    by_compute = plan_pipeline(model, plan, 2, 2, cap.graph, activations=cap.activations)
    assert [len(s.blocks) for s in by_compute.stages] == [5, 1]
    assert [len(s.blocks) for s in plan_pipeline(model, plan, 2, 2, cap.graph).stages] == [3, 3]  # no inputs
    # equal compute goes by parameter bytes
    profile = ActivationProfile(0, [BlockCallActivations(b, 0, 0, flops=7) for b in "abc"])
    assert balanced_split(block_costs(list("abc"), {"a": 1, "b": 1, "c": 5}, profile), 2) == [2]
    assert balanced_split(block_costs(list("abc"), {"a": 5, "b": 1, "c": 1}, profile), 2) == [1]
    # a profile without FLOPs for some block (none counted) falls back to parameter bytes
    assert block_costs(list("ab"), {"a": 3, "b": 4}, ActivationProfile(0, [BlockCallActivations("a", 0, 0, 9)])) == [3, 4]


def test_the_last_stage_weighs_the_head_and_loss_after_its_blocks() -> None:
    # A head over a large vocabulary costs more than a block (here 2 x 32 x 1024 FLOPs per token against a
    # block's about 2 x 12 x 32 x 32): only the last stage runs it, so it weighs there, and the stages cut
    # 3 / 1 blocks, not 2 / 2 (the last stage then paced the pipeline with two blocks and the head).
    model = models.ToyGPT(n_layers=4, vocab=1024)
    discovery = passes.discover_blocks(model)
    batch, seq = 2, 8
    ids = torch.randint(0, 1024, (batch, seq))
    cap = passes.capture(model, discovery, ((ids, ids), {}))
    plan = passes.build_plan(model, discovery, world_size=2, capture=cap)
    assert cap.activations is not None
    assert cap.activations.tail_flops == 2 * batch * seq * models.DIM * 1024  # the head's matmul (the loss: none)
    block = cap.activations.calls[0].flops
    assert 0 < block < cap.activations.tail_flops / 2, (block, cap.activations.tail_flops)
    section = plan_pipeline(model, plan, 2, 2, cap.graph, activations=cap.activations)
    assert [len(s.blocks) for s in section.stages] == [3, 1]


# ---- everything that reads parameters -------------------------------------------------------------------------
def _readers_body(tmp: str) -> dict:
    import copy

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    use_pipeline(2)
    out = {}
    torch.manual_seed(0)
    ref = models.ToyGPT(n_layers=4, tie=True)
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref))
    # state_dict() and bmt.save: whole tensors under the original names, from every stage
    state = model.state_dict()
    out["state_dict"] = list(state) == list(ref.state_dict()) and all(
        torch.equal(state[k], v) for k, v in ref.state_dict().items())
    with bmt.gathered(model):  # every stage's parameters whole, on every rank
        out["gathered"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    bmt.save(model, f"{tmp}/model.safetensors")
    torch.manual_seed(5)
    other = bmt.BMTrainModelWrapper(models.ToyGPT(n_layers=4, tie=True))
    bmt.load(other, f"{tmp}/model.safetensors")
    out["load"] = all(torch.equal(other.state_dict()[k], v) for k, v in ref.state_dict().items())
    # DCP's sharded state dict: each stage's ranks write their shards, a fresh model reads them back
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, targets = lm_batches(1, 2, vocab=models.VOCAB)[0]
    model(ids, targets).backward()
    opt.step()
    opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{tmp}/dcp")
    full = {k: v.detach().cpu() for k, v in get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True))[0].items()}
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other(ids, targets).backward()
    opt2.step()
    msd2, osd2 = get_state_dict(other, opt2)
    loaded = {"model": msd2, "optim": osd2}
    dcp.load(loaded, checkpoint_id=f"{tmp}/dcp")
    set_state_dict(other, opt2, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    full2 = get_state_dict(other, opt2, options=StateDictOptions(full_state_dict=True))[0]
    out["dcp"] = all(torch.equal(full[k], full2[k].cpu()) for k in full)
    del model, other, opt, opt2
    gc.collect()
    # generate(): every forward without gradients runs whole, the last stage's logits shared, each stage's
    # own layers filling its KV cache
    llama = models.llama()
    wrapped = bmt.BMTrainModelWrapper(copy.deepcopy(llama))
    # bmt.save of a transformers model split over the stages: transformers' from_pretrained reads it whole
    if bmt.rank() == 0:  # bmt.save writes on rank 0, and agrees before any rank reads
        llama.config.save_pretrained(f"{tmp}/hf")
    bmt.save(wrapped, f"{tmp}/hf/model.safetensors")
    loaded = type(llama).from_pretrained(f"{tmp}/hf").state_dict()
    out["from_pretrained"] = list(loaded) == list(llama.state_dict()) and all(
        torch.equal(loaded[k], v) for k, v in llama.state_dict().items())
    prompt = models.token_ids(batch=2, seq=5)
    out["generate"] = torch.equal(llama.generate(prompt, max_new_tokens=4, do_sample=False),
                                  wrapped.generate(prompt, max_new_tokens=4, do_sample=False))
    del wrapped
    gc.collect()
    # fused_loss=True: the last stage's head and loss run as one chunked op
    fused = _train("llama", "sgd", {"fused_loss": True})
    out["fused"] = fused["losses"]
    return out


def test_state_dict_gathered_save_load_dcp_generate_and_fused_loss_read_every_stage(tmp_path) -> None:
    results = run_distributed(_readers_body, 2, str(tmp_path))
    for r in results:
        assert {k: v for k, v in r.items() if k != "fused"} == {
            "state_dict": True, "gathered": True, "load": True, "dcp": True, "from_pretrained": True,
            "generate": True}, r
    assert results[0]["fused"] == results[1]["fused"]


def _no_sync_body() -> str:
    import copy

    from parity import compare_grads

    use_pipeline(2)
    torch.manual_seed(0)
    ref = models.ToyGPT(n_layers=4, tie=True)
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref))
    n, r = bmt.data_parallel_size(), bmt.data_parallel_rank()
    for i, (ids, targets) in enumerate(lm_batches(3, 4, vocab=models.VOCAB)):
        ref(ids, targets).div(3).backward()
        local = (ids.chunk(n)[r], targets.chunk(n)[r])
        if i < 2:  # two micro-steps accumulate unreduced, the third reduces all three
            with model.no_sync():
                model(*local).div(3).backward()
        else:
            model(*local).div(3).backward()
    compare_grads(ref, model, "after a no_sync window")
    return "ok"


def test_no_sync_accumulates_like_plain_pytorch_at_pp2_dp2() -> None:
    assert run_distributed(_no_sync_body, 4) == ["ok"] * 4


# ---- sharded checkpoints resume at other layouts ------------------------------------------------------------
SAVE_AT, STEPS = 2, 4


def _managed(pipe_size: int, seed: int) -> tuple[nn.Module, object]:
    use_pipeline(pipe_size)
    torch.manual_seed(seed)
    model = bmt.BMTrainModelWrapper(models.ToyGPT(n_layers=4, tie=True))
    mgr = bmt.optim.OptimManager(loss_scale=2.0 ** 10)
    mgr.add_optimizer(bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2, weight_decay=0.1))
    return model, mgr


def _ckpt_save_body(tmp: str, pipe_size: int) -> list[float]:
    from parity import train_managed

    model, mgr = _managed(pipe_size, 0)
    train_managed(model, mgr, lm_batches(STEPS, 4), range(SAVE_AT))
    bmt.save_checkpoint(f"{tmp}/ckpt", model, mgr, step=SAVE_AT)
    losses = train_managed(model, mgr, lm_batches(STEPS, 4), range(SAVE_AT, STEPS))
    bmt.save(model, f"{tmp}/final.safetensors")
    return losses


def _ckpt_load_body(tmp: str, pipe_size: int, expected: list[float]) -> float:
    import safetensors
    from parity import ADAMW_REL, LOSS_RTOL, train_managed, whole

    model, mgr = _managed(pipe_size, 1)  # another init: everything must come from the checkpoint
    bmt.load_checkpoint(f"{tmp}/ckpt", model, mgr)
    losses = train_managed(model, mgr, lm_batches(STEPS, 4), range(SAVE_AT, STEPS))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=LOSS_RTOL, atol=0)
    worst = 0.0
    with safetensors.safe_open(f"{tmp}/final.safetensors", "pt") as f:
        for name, p in model.named_parameters():
            want = f.get_tensor(name)
            rel = float((whole(p) - want).norm() / want.norm().clamp_min(1e-12))
            assert rel <= ADAMW_REL, f"{name}: relative difference {rel:.2e}"
            worst = max(worst, rel)
    return worst


def test_sharded_checkpoints_resume_across_pipeline_layouts(tmp_path) -> None:
    # pp2 x dp2 -> pp2 (2 ranks) and -> one rank; pp1 (dp2) -> pp2
    expected = run_distributed(_ckpt_save_body, 4, str(tmp_path / "a"), 2)[0]
    run_distributed(_ckpt_load_body, 2, str(tmp_path / "a"), 2, expected)
    run_distributed(_ckpt_load_body, 1, str(tmp_path / "a"), 1, expected)
    expected = run_distributed(_ckpt_save_body, 2, str(tmp_path / "b"), 1)[0]
    run_distributed(_ckpt_load_body, 2, str(tmp_path / "b"), 2, expected)
