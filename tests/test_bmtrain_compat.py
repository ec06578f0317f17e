"""BMTrain code runs after the import swap: its names, module paths and semantics, on our engine.

Each test reads what one of BMTrain's own tests checks (named in its docstring) and checks it our way,
against plain PyTorch where numbers are involved.
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_distributed
from parity import compare_grads, compare_params
from torch import nn

import bmt_wrap as bmt
from bmt_wrap.checkpoint.formats import open_source
from bmt_wrap.errors import BlockListError, BMTError, CommError, InitError, UnsupportedError, WrapError
from bmt_wrap.runtime.sharded_tensor import ShardedTensor

D = 8


# ---- names and module paths ------------------------------------------------------------------------------
def _names_body() -> dict:
    from bmt_wrap.block_layer import Block, CheckpointBlock, CheckpointBlockContext, TransformerBlockList
    from bmt_wrap.global_var import config
    from bmt_wrap.pipe_layer import PipelineTransformerBlockList
    from bmt_wrap.store import allgather_object
    from bmt_wrap.synchronize import gather_result

    assert config is bmt.config and Block is CheckpointBlock is bmt.CheckpointBlock
    assert TransformerBlockList is bmt.TransformerBlockList and PipelineTransformerBlockList is bmt.PipelineTransformerBlockList
    assert callable(bmt.synchronize) and gather_result is bmt.gather_result and allgather_object is bmt.store.allgather_object
    assert bmt.distributed.init_distributed is bmt.init_distributed, "bmt.distributed is still our module"
    assert bmt.init_distributed(seed=0, backend="gloo", timeout=bmt.get_state().timeout, pipe_size=1, tp_size=1) \
        is bmt.get_state()
    with pytest.raises(InitError, match="pipe_size x tp_size"):  # pipelines: tests/test_pipeline_bmtrain.py
        bmt.init_distributed(seed=0, backend="gloo", timeout=bmt.get_state().timeout, pipe_size=3)
    with pytest.raises(InitError, match="must be a multiple of tp_size"):
        bmt.init_distributed(seed=0, backend="gloo", timeout=bmt.get_state().timeout, tp_size=3)
    with pytest.raises(BMTError, match="cannot be set"):
        bmt.config["rank"] = 3
    bmt.config["my_key"] = 1  # a script's own keys are stored
    with pytest.raises(UnsupportedError, match="internal gather context"):
        CheckpointBlockContext()
    bmt.synchronize()
    return {k: bmt.config[k] for k in ("rank", "world_size", "tp_size", "pipe_size", "initialized", "my_key")} | {
        "comm": bmt.config["comm"] is bmt.get_state().comm}


def test_config_module_paths_and_parallel_sizes() -> None:
    results = run_distributed(_names_body, 2)
    assert results == [{"rank": r, "world_size": 2, "tp_size": 1, "pipe_size": 1, "initialized": True,
                        "my_key": 1, "comm": True} for r in range(2)]


# ---- bmt.distributed: differentiable collectives (BMTrain's test_nccl_backward) --------------------------------
def _collectives_body() -> None:
    r, n = bmt.rank(), bmt.world_size()
    values = torch.arange(1.0, n * 6 + 1).view(n, 2, 3)  # rank i holds values[i]
    cases = {"sum": values.sum(0), "avg": values.mean(0), "max": values.max(0).values,
             "min": values.min(0).values, "prod": values.prod(0)}
    for op, want in cases.items():
        x = values[r].clone().requires_grad_(True)
        y = bmt.distributed.all_reduce(x, op)
        torch.testing.assert_close(y, want)
        g = torch.full_like(y, 2.0)
        (y * g).sum().backward()
        local = {"sum": g, "avg": g / n, "max": g * (values[r] == want), "min": g * (values[r] == want),
                 "prod": g * want / values[r]}[op]  # BMTrain: the gradient of this rank's copy only
        torch.testing.assert_close(x.grad, local, msg=op)
    x = values[r].clone().requires_grad_(True)
    gathered = bmt.distributed.all_gather(x)
    torch.testing.assert_close(gathered, values)
    (gathered * torch.arange(gathered.numel()).view_as(gathered)).sum().backward()
    torch.testing.assert_close(x.grad, torch.arange(gathered.numel()).view_as(gathered)[r].float())
    full = torch.arange(float(n * 4 * 3)).view(n * 4, 3) * (r + 1)
    x = full.clone().requires_grad_(True)
    y = bmt.distributed.reduce_scatter(x, "sum")
    total = sum(torch.arange(float(n * 4 * 3)).view(n * 4, 3) * (i + 1) for i in range(n))
    torch.testing.assert_close(y, total[4 * r:4 * (r + 1)])
    g = torch.randn(4, 3, generator=torch.Generator().manual_seed(r))
    (grad,) = torch.autograd.grad(y, x, g)
    torch.testing.assert_close(grad[4 * r:4 * (r + 1)], g)
    torch.testing.assert_close(bmt.distributed.reduce_scatter(full, "max"), (full / (r + 1) * n)[4 * r:4 * (r + 1)])
    with pytest.raises(CommError, match="multiple of the world size"):
        bmt.distributed.reduce_scatter(torch.ones(n + 1))
    x = torch.full((3,), float(r + 1), requires_grad=True)
    y = bmt.distributed.broadcast(x, 1)
    torch.testing.assert_close(y, torch.full((3,), 2.0))
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), float(n)))  # BMTrain: the summed output gradient
    half = torch.full((4,), float(r + 1), dtype=torch.half, requires_grad=True)
    out = bmt.distributed.all_reduce(half, "prod")
    assert out.dtype == torch.half and float(out[0]) == float(torch.arange(1, n + 1).prod())


def test_differentiable_collectives() -> None:
    run_distributed(_collectives_body, 2)


def _nccl_store_body() -> list:
    r, n = bmt.rank(), bmt.world_size()
    comm = bmt.config["comm"]
    assert bmt.nccl.commCount(comm) == n and bmt.nccl.commRank(comm) == r
    x = torch.full((4,), float(r + 1))
    bmt.nccl.allReduce(x.storage(), x.storage(), "sum", comm)  # in place, on storages as BMTrain passes them
    assert x.tolist() == [float(n * (n + 1) // 2)] * 4
    src, dst = torch.full((2,), float(r)), torch.empty(2 * n)
    bmt.nccl.allGather(src.storage(), dst.storage(), comm)
    assert dst.tolist() == [float(i) for i in range(n) for _ in range(2)]
    full, part = torch.arange(float(2 * n)), torch.empty(2)
    bmt.nccl.reduceScatter(full.storage(), part.storage(), "avg", comm)
    assert part.tolist() == [float(2 * r), float(2 * r + 1)]
    b = torch.full((3,), float(r))
    bmt.nccl.groupStart()
    bmt.nccl.broadcast(b.storage(), b.storage(), 1, comm)
    bmt.nccl.groupEnd()
    assert b.tolist() == [1.0] * 3
    with pytest.raises(UnsupportedError, match="send"):
        bmt.nccl.send(b.storage(), 1 - r, comm)
    with pytest.raises(CommError, match="one communicator per job"):
        bmt.distributed.all_reduce(b, "sum", comm=object())
    rows = torch.full((r + 1, 2), float(r))[:1]  # a slice of a bigger tensor, as BMTrain's test passes
    torch.testing.assert_close(bmt.gather_result(rows), torch.tensor([[float(i)] * 2 for i in range(n)]))
    gathered = bmt.store.allgather_object({"rank": r, "tail": "x" * r}, comm)
    assert gathered == [{"rank": i, "tail": "x" * i} for i in range(n)]
    assert bmt.store.allgather_objects(r) == list(range(n))
    return bmt.store.broadcast_object(("from", r), comm, src=1)


def test_nccl_calls_and_object_store() -> None:
    assert run_distributed(_nccl_store_body, 2) == [("from", 1)] * 2


# ---- small helpers ------------------------------------------------------------------------------------------
def test_has_inf_nan_and_average_recorder() -> None:
    from bmt_wrap.loss._function import has_inf_nan

    out = torch.zeros(1, dtype=torch.uint8)[0]
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x = torch.rand(1000).to(dtype)
        has_inf_nan(x, out)
        assert out.item() == 0
        x[17] = float("inf")
        has_inf_nan(x, out)
        assert out.item() == 1
        x[17], x[3] = 1.0, float("nan")
        has_inf_nan(x, out)
        assert out.item() == 1
    with pytest.raises(BMTError, match="uint8"):
        has_inf_nan(x, torch.zeros(1))
    rec = bmt.utils.AverageRecorder(alpha=0.5)
    assert rec.value == 0
    for v in (4.0, 2.0):
        rec.record(v)
    assert rec.value == pytest.approx((0.25 * 4 + 0.5 * 2) / 0.75)  # bias-corrected moving average


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fused_cross_entropy_class_weights_match_torch(reduction: str) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 10, generator=g, requires_grad=True)
    target = torch.randint(0, 10, (64,), generator=g)
    target[::5] = -100
    weight = torch.rand(10, generator=g) + 0.5
    ours = bmt.loss.FusedCrossEntropy(weight, reduction=reduction)(logits, target)  # weight first, as BMTrain
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits, target, weight=weight, reduction=reduction)
    torch.testing.assert_close(ours, ref)
    ours.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)
    with pytest.raises(UnsupportedError, match="label_smoothing"):
        bmt.loss.FusedCrossEntropy(parallel=True, label_smoothing=0.1)


# ---- bmt.nn.Linear and blocks ---------------------------------------------------------------------------------
class _TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.b(torch.tanh(self.a(x)))


def _linear_body() -> None:
    torch.manual_seed(0)
    layer = bmt.nn.Linear(D, 4)
    ref = nn.Linear(D, 4)
    with bmt.gathered(layer):
        ref.load_state_dict({k: v.detach().clone() for k, v in layer.state_dict().items()})
    assert ref.weight.std() > 0 and not ref.bias.any(), "drawn Xavier-normal and zeros at construction"
    block = bmt.CheckpointBlock(layer)
    x = torch.randn(2 * bmt.world_size(), D)
    F.mse_loss(ref(x), torch.zeros(2 * bmt.world_size(), 4)).backward()
    xs = x.chunk(bmt.world_size())[bmt.rank()]
    F.mse_loss(block(xs), torch.zeros(2, 4)).backward()
    compare_grads(ref, block, "bmt.nn.Linear")


def test_nn_linear_matches_torch_linear() -> None:
    run_distributed(_linear_body, 2)


class _Lists(nn.Module):
    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x, x * 2, x * 3]


def _list_body() -> None:
    out = bmt.Block(_Lists())(torch.ones(3))
    assert isinstance(out, tuple) and len(out) == 3 and out[2].tolist() == [3.0] * 3


def test_block_returns_a_list_as_a_tuple() -> None:
    """BMTrain's test_different_output_shape."""
    run_distributed(_list_body, 1)


def _duplicate_body() -> None:
    torch.manual_seed(0)
    ref_layer = _TwoLinears()
    layer = copy.deepcopy(ref_layer)
    blocks = bmt.TransformerBlockList([layer, layer])  # BMTrain's test_same_layer: one block run twice
    assert blocks[0] is not blocks[1]
    assert [n for n, _ in blocks.named_parameters()] == ["0.a.weight", "0.a.bias", "0.b.weight", "0.b.bias"]
    assert set(blocks.state_dict()) == {f"{i}.{p}" for i in "01" for p in ("a.weight", "a.bias", "b.weight", "b.bias")}
    x = torch.randn(2 * bmt.world_size(), D)
    ref_layer(ref_layer(x)).pow(2).mean().backward()
    blocks(x.chunk(bmt.world_size())[bmt.rank()]).pow(2).mean().backward()
    ref = nn.ModuleDict({"0": ref_layer})
    compare_grads(ref, blocks, "shared layer")
    assert layer.count == 4, "two forwards and two recomputes"
    block = bmt.Block(_TwoLinears())
    with pytest.raises(BlockListError, match="given twice") as info:
        bmt.TransformerBlockList([block, block])  # BMTrain's test_no_grad_error
    assert isinstance(info.value, AssertionError), "BMTrain raises AssertionError; code written for it catches that"
    with pytest.raises(AssertionError, match="mode='PIPE'"):
        bmt.PipelineTransformerBlockList([block])  # BMTrain's test_no_grad_error2
    pipe = bmt.PipelineTransformerBlockList([_TwoLinears(), bmt.Block(_TwoLinears(), mode="PIPE")])
    assert pipe(torch.ones(1, D)).shape == (1, D)


def test_block_list_duplicates_follow_bmtrain() -> None:
    run_distributed(_duplicate_body, 2)


# ---- freezing after wrapping (BMTrain's test_requires_grad, test_no_grad) --------------------------------------
def _freeze_body() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(_TwoLinears(), _TwoLinears())
    model = bmt.TransformerBlockList([copy.deepcopy(m) for m in ref])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    n, r = bmt.world_size(), bmt.rank()
    for step in range(3):
        if step == 1:  # freeze after wrapping: one parameter of block 0, then all of block 0
            for m in (ref[0], model[0]):
                m.a.weight.requires_grad_(False)
        if step == 2:
            for m in (ref[0], model[0]):
                m.requires_grad_(False)
        x = torch.randn(2 * n, D, generator=torch.Generator().manual_seed(step))
        ref(x).pow(2).mean().backward()
        out = model(x.chunk(n)[r])
        out.pow(2).mean().backward()
        compare_grads(ref, model, f"step {step}")  # a frozen parameter keeps the .grad it had, as in torch
        ref_opt.step()
        opt.step()
        compare_params(ref, model, "sgd", f"step {step}")
    first = model[0]
    x = torch.randn(2, D)
    before = first.count
    y = first(x)
    assert not y.requires_grad, "an all-frozen block with inputs that need no gradient builds no graph"
    model[1](y).sum().backward()
    assert first.count == before + 1, "and is not recomputed in backward"


def test_freezing_after_wrapping_is_honoured() -> None:
    run_distributed(_freeze_body, 2)


def _unfreeze_body() -> None:
    m = _TwoLinears()
    m.a.bias.requires_grad_(False)
    block = bmt.Block(m)
    block.a.bias.requires_grad_(True)
    with pytest.raises(WrapError, match="Set requires_grad before wrapping"):
        block(torch.ones(1, D))


def test_unfreezing_a_parameter_frozen_when_wrapped_raises() -> None:
    run_distributed(_unfreeze_body, 1)


# ---- inspect table layout -----------------------------------------------------------------------------------
def test_format_summary_has_bmtrains_layout() -> None:
    """BMTrain's test_requires_grad parses line 1 and 2 and the last two words of a line."""
    rows = [{"name": "0.weight", "shape": (16, 16), "mean": 0.5, "std": 0.25, "min": -1.0, "max": 1.0,
             "grad_mean": 0.125, "grad_std": 2.0, "grad_min": 0.0, "grad_max": 3.0},
            {"name": "0.bias", "shape": (16,), "mean": 0.0, "std": 0.0, "min": 0.0, "max": 0.0,
             "grad_mean": None, "grad_std": None, "grad_min": None, "grad_max": None}]
    lines = bmt.inspect.format_summary(rows).split("\n")
    assert lines[0].split() == ["name", "shape", "max", "min", "std", "mean", "grad_std", "grad_mean"]
    assert lines[1].split() == ["0.weight", "(16,", "16)", "1.0000", "-1.0000", "0.2500", "0.5000", "2.0000", "0.1250"]
    assert lines[2].split()[-2:] == ["0.0000", "0.0000"], "no gradient prints as zeros, as BMTrain does"
    assert len(lines) == 3 and len({len(line) for line in lines}) == 1, "fixed-width cells"


# ---- save/load and deep copies ----------------------------------------------------------------------------------
class _WithPlain(bmt.DistributedModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = bmt.DistributedParameter(torch.randn(3, 4))
        self.scale = nn.Parameter(torch.randn(2, 5), requires_grad=False)  # plain, outside every block


def _save_load_body(path: str) -> None:
    torch.manual_seed(0)
    model = _WithPlain()
    bmt.save(model, path)
    assert open_source(Path(path)).info("scale")[0] == (2, 5), "the file holds the full shape"
    other = _WithPlain()
    other.scale.data.zero_()
    bmt.load(other, path)
    torch.testing.assert_close(other.scale, model.scale)
    torch.testing.assert_close(other.w, model.w)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_save_then_load_plain_parameters_outside_blocks(tmp_path: object, suffix: str) -> None:
    run_distributed(_save_load_body, 2, str(tmp_path / f"m{suffix}"))  # type: ignore[operator]


def _deepcopy_body() -> None:
    block = bmt.Block(_TwoLinears())
    snapshot = copy.deepcopy(list(block.parameters()))  # BMTrain's test_optim_state does this
    # A copy of this rank's range with the parameter's shape (BMTrain's is a 1-D slice; docs/migration.md).
    assert all(isinstance(s, ShardedTensor) and s.shape == p.shape and torch.equal(s, p)
               for s, p in zip(snapshot, block.parameters(), strict=True))
    i, biggest = max(enumerate(block.parameters()), key=lambda ip: ip[1].numel())
    with torch.no_grad():
        biggest.add_(1)
    assert not torch.equal(snapshot[i], biggest), "a copy, not a view"
    with pytest.raises(TypeError, match="deepcopy a model"):
        copy.deepcopy(bmt.nn.Linear(D, D))
    with pytest.raises(TypeError, match="pickle"):
        pickle.dumps(biggest)


def test_deepcopy_of_parameters_copies_this_ranks_range() -> None:
    run_distributed(_deepcopy_body, 2)


# ---- wrapped layers inside blocks, blocks inside wrapped models ------------------------------------------------
class _SubWithWrapped(bmt.DistributedModule):
    """BMTrain's test_optim_state: wrapped Linears and a bare DistributedParameter in a DistributedModule."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = bmt.BMTrainModelWrapper(nn.Linear(D, 2 * D))
        self.bias = bmt.DistributedParameter(torch.zeros(2 * D))
        self.fc2 = bmt.BMTrainModelWrapper(nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x) + self.bias))


class _PlainSub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D)
        self.bias = nn.Parameter(torch.zeros(2 * D))
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x) + self.bias))


def _wrapped_in_block_body() -> None:
    torch.manual_seed(0)
    ref = nn.ModuleDict({"layer1": _PlainSub(), "layer2": _PlainSub()})
    torch.manual_seed(0)
    model = nn.ModuleDict({"layer1": _SubWithWrapped(), "layer2": bmt.CheckpointBlock(_SubWithWrapped())})
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    for name in ("layer1", "layer2"):
        model[name].load_state_dict({k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(name)})
    n, r = bmt.world_size(), bmt.rank()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(2 * n, D, generator=torch.Generator().manual_seed(step))
        ref["layer2"](ref["layer1"](x)).pow(2).mean().backward()
        model["layer2"](model["layer1"](x.chunk(n)[r])).pow(2).mean().backward()
        compare_grads(ref, model, f"step {step}")
        ref_opt.step()
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        compare_params(ref, model, "sgd", f"step {step}")


def test_checkpoint_block_over_wrapped_children_trains_like_pytorch() -> None:
    run_distributed(_wrapped_in_block_body, 2)


def _wrap_over_block_body() -> str:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Linear(D, D)
            self.shared = bmt.CheckpointBlock(nn.Linear(D, D))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.shared(self.shared(self.emb(x)))

    with pytest.raises(WrapError, match="already holds sharded parts") as info:
        bmt.BMTrainModelWrapper(Shared())
    bmt.synchronize()  # every rank raised before any collective: the group is still in step
    return str(info.value)


def test_wrapper_over_a_checkpoint_block_raises_on_every_rank() -> None:
    messages = run_distributed(_wrap_over_block_body, 2, timeout=60)
    assert all("shared" in m for m in messages)


# ---- inspect_tensor / record_tensor (BMTrain's example/train.py) ----------------------------------------------
class _Recording(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        bmt.inspect.record_tensor(h, "hidden")
        return h


def _inspect_tensor_body(use_checkpoint: bool) -> list[dict]:
    torch.manual_seed(0)
    ref = nn.ModuleList([_Recording(), _Recording()])
    model = bmt.TransformerBlockList([bmt.Block(copy.deepcopy(m), use_checkpoint=use_checkpoint) for m in ref])
    n, r = bmt.world_size(), bmt.rank()
    x = torch.randn(2 * n, D, generator=torch.Generator().manual_seed(3))
    with bmt.inspect.inspect_tensor() as inspector:
        out = model(x.chunk(n)[r])
        bmt.inspect.record_tensor(out, "out")
        out.pow(2).sum().backward()
    summary = inspector.get_summary()
    hidden = []
    h = x
    for m in ref:  # the reference: the same values and gradients over the whole batch
        h = torch.tanh(m.fc(h))
        h.retain_grad()
        hidden.append(h)
    h.pow(2).sum().backward()
    assert [row["name"] for row in summary] == ["0.hidden", "1.hidden", "out"]
    for row, want in zip(summary, [*hidden, hidden[-1]], strict=True):
        for k in ("mean", "std", "min", "max"):
            assert row[k] == pytest.approx(float(getattr(want, k)()), rel=1e-5, abs=1e-6), (row["name"], k)
            assert row[f"grad_{k}"] == pytest.approx(float(getattr(want.grad, k)()), rel=1e-5, abs=1e-6), (row["name"], k)
    assert inspector.get_tensor("hidden", index=1).shape == (2, D)
    return summary


@pytest.mark.parametrize("use_checkpoint", [True, False])
def test_inspect_tensor_records_values_and_gradients(use_checkpoint: bool) -> None:
    run_distributed(_inspect_tensor_body, 2, use_checkpoint)


# ---- BMTrain's test_grad_accu and test_init_parameters, as they are written (issue 28 item 5) ---------
class _BmtLinear(bmt.DistributedModule):
    """BMTrain's tests' Linear: two DistributedParameters drawn by init_method."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = bmt.DistributedParameter(torch.empty(d_out, d_in), init_method=nn.init.xavier_normal_)
        self.bias = bmt.DistributedParameter(torch.empty(d_out), init_method=nn.init.zeros_)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _grad_accu_body() -> list[bool]:
    answers = []
    for make in (lambda: _BmtLinear(3 * D, 3 * D), lambda: bmt.CheckpointBlock(_BmtLinear(3 * D, 3 * D)),
                 lambda: bmt.TransformerBlockList([bmt.CheckpointBlock(_BmtLinear(3 * D, 3 * D))])):
        m = make()
        bmt.init_parameters(m)
        weight = next(p for name, p in m.named_parameters() if name.endswith("weight"))
        inp = torch.randn(1, 10, 3 * D)
        m(inp).sum().backward()
        grad1 = weight.grad.clone()
        m(inp).sum().backward()
        grad2 = weight.grad
        assert torch.allclose(grad1 * 2, grad2)  # BMTrain's assertion, on sharded gradients
        answers.append(torch.allclose(grad1, grad2))  # a full reduction: the same (False) on every rank
    return answers


@pytest.mark.parametrize("world_size", [1, 2])
def test_allclose_of_sharded_gradients_as_bmtrains_grad_accu_compares_them(world_size: int) -> None:
    assert run_distributed(_grad_accu_body, world_size) == [[False] * 3] * world_size


def _init_parameters_body() -> int:
    shape = (3, 5)
    torch.manual_seed(33)
    weight = nn.init.xavier_normal_(torch.empty(shape))  # BMTrain's Linear_NormalInitBefore
    plain = nn.Linear(*reversed(shape))
    with torch.no_grad():
        plain.weight.copy_(weight)
        plain.bias.zero_()
    want = (plain.weight.data.clone().view(-1), plain.bias.data.clone().view(-1))
    torch.manual_seed(33)
    drawn = _BmtLinear(*reversed(shape))
    bmt.init_parameters(drawn)
    torch.manual_seed(33)
    block = bmt.CheckpointBlock(_BmtLinear(*reversed(shape)))
    bmt.init_parameters(block)
    wrapped = bmt.BMTrainModelWrapper(plain)
    rets = [want] + [(m.weight.data.view(-1), m.bias.data.view(-1)) for m in (drawn, block, wrapped)]
    for a in rets:  # BMTrain compares flattened .data of plain and sharded parameters, every pair
        for b in rets:
            assert (a[0] == b[0]).all() and (a[1] == b[1]).all()
            assert a[0].shape == (15,) and a[0].flatten().shape == a[0].reshape(-1).shape == (15,)
    flat = wrapped.weight.data.view(-1)
    assert isinstance(flat, ShardedTensor) and torch.equal(flat.to_local(), wrapped.weight.to_local())
    assert not (flat == want[0] + 1).all()
    bmt.reset_comm_stats()
    assert (flat == want[0]).all() and (flat.view(shape) == weight).all()
    return bmt.comm_stats().get("materialize", {}).get("calls", 0)


@pytest.mark.parametrize("world_size", [1, 2])
def test_flattened_data_of_sharded_parameters_compares_as_bmtrains_init_parameters(world_size: int) -> None:
    calls = run_distributed(_init_parameters_body, world_size)
    assert calls == [0] * world_size, "compared with a plain tensor: local"
