"""BMTrain's pipeline API after the import swap: ``init_distributed(pipe_size=P)``, its config keys,
``bmt.distributed.send_activations``/``recv_activations`` and ``PipelineTransformerBlockList`` over P stages.

Each body reads what one of BMTrain's tests checks (named in its docstring) and checks it our way; the
block list trains against plain PyTorch in one process (docs/design.md's tolerances).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from dist_harness import COMM_TIMEOUT, run_distributed
from parity import train_side_by_side
from torch import nn

import bmt_wrap as bmt
from bmt_wrap.errors import InitError, PipelineError, PipelineInputMismatchError

D = 8


def use_pipeline(pipe_size: int, **kwargs: int) -> None:
    """What a BMTrain script's ``bmt.init_distributed(pipe_size=P)`` does, inside a persistent worker."""
    bmt.init_distributed(seed=0, backend="gloo", timeout=COMM_TIMEOUT, pipe_size=pipe_size, **kwargs)


# ---- layout, config keys and send/recv (BMTrain's test_send_recv) ------------------------------------------
def _layout_body() -> dict:
    use_pipeline(2)
    config, topo = bmt.config, bmt.config["topology"]
    out = {"pipe_size": config["pipe_size"], "stage": topo.stage_id, "pipe_rank": config["pipe_rank"],
           "pipe_idx": topo.pipe_idx, "pp_zero_id": topo.pp_zero_id, "micros": config["micros"],
           "zero_size": config["zero_size"], "data": (bmt.data_parallel_rank(), bmt.data_parallel_size()),
           "next": topo.next_rank, "prev": topo.prev_rank}
    # BMTrain's test_send_recv, as written: stage 0 sends, stage 1 receives, over config["pipe_comm"].
    if topo.stage_id == 0:
        a = torch.ones((2, 1)) * (topo.pp_zero_id + 1)
        bmt.distributed.send_activations(a, 1, config["pipe_comm"])
    else:
        ref = torch.ones((2, 1)) * (topo.pp_zero_id + 1)
        a = bmt.distributed.recv_activations(0, config["pipe_comm"])
        assert torch.equal(a, ref) and a.dtype == ref.dtype, a
        b = torch.arange(6, dtype=torch.int32).view(3, 2) + topo.pp_zero_id
    if topo.stage_id == 1:  # and back, another dtype and shape
        bmt.distributed.send_activations(b, 0, config["pipe_comm"])
    else:
        got = bmt.distributed.recv_activations(1, config["pipe_comm"])
        assert torch.equal(got, torch.arange(6, dtype=torch.int32).view(3, 2) + topo.pp_zero_id), got
    with pytest.raises(InitError, match="pipe_size x tp_size"):
        use_pipeline(3)
    return out


def test_pipe_size_lays_stages_out_as_bmtrain_does() -> None:
    results = run_distributed(_layout_body, 4)
    for rank, got in enumerate(results):
        stage, place = rank // 2, rank % 2  # stage = rank // (world / P); the pipe group: one place in each stage
        assert got == {"pipe_size": 2, "stage": stage, "pipe_rank": stage, "pipe_idx": place, "pp_zero_id": place,
                       "micros": 2, "zero_size": 2, "data": (place, 2), "next": 1 if stage == 0 else -1,
                       "prev": -1 if stage == 0 else 0}, (rank, got)


# ---- PipelineTransformerBlockList trains like plain PyTorch ------------------------------------------------
class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.w(x)) * scale


class _Net(nn.Module):
    """pre -> 5 layers -> post, as BMTrain's tests build theirs (test_inspector_hidden's Model_PIPE)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(D, D)
        self.blocks = nn.ModuleList([_Layer() for _ in range(5)])
        self.post = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        scale = torch.full((h.shape[0], 1), 0.9)  # a second, batch-cut argument of every block
        if isinstance(self.blocks, bmt.PipelineTransformerBlockList):
            h = self.blocks(h, scale)
        else:
            for block in self.blocks:
                h = block(h, scale)
        return F.mse_loss(self.post(h), y)


def _explicit(model: _Net) -> _Net:
    """The BMTrain way: the root's layers as blocks of their own, the layers in a pipeline block list."""
    model.pre = bmt.Block(model.pre)
    model.post = bmt.Block(model.post)
    model.blocks = bmt.PipelineTransformerBlockList(list(model.blocks))
    return model


def _train_body(micros: int | None) -> dict:
    use_pipeline(2, **({"num_micro_batches": micros} if micros else {}))
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, D, generator=g), torch.randn(8, 1, generator=g)) for _ in range(3)]
    result = train_side_by_side(_Net, _explicit, batches,
                                data_parallel=(bmt.data_parallel_rank(), bmt.data_parallel_size()))
    torch.manual_seed(0)
    ref = _Net()
    model = _explicit(copy.deepcopy(ref))
    x, y = batches[0]
    ref(x, y).backward()
    rank, n = bmt.data_parallel_rank(), bmt.data_parallel_size()
    model(x.chunk(n)[rank], y.chunk(n)[rank]).backward()
    # The norm of the whole gradient on every rank: torch's own clip_grad_norm_ and bmt's.
    want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
    norms = [float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, foreach=f)) for f in (True, False)]
    norms.append(float(bmt.optim.clip_grad_norm_(model.parameters(), 1e9)))
    assert all(abs(v - want) <= 1e-5 * want for v in norms), (norms, want)
    own = [i for i, b in enumerate(model.blocks) if b._bmt_group.buffers[0].shard.numel() > 0]
    # A rank holds its own stage's blocks only (BMTrain's split: 3 blocks on stage 0, 2 on stage 1).
    held = {"own": own, "layer_ids": list(model.blocks.layer_ids)}
    # Stages given different batches are told so, on every rank, before any block runs.
    x = torch.randn(4, D) + bmt.config["pipe_rank"]
    with pytest.raises(PipelineInputMismatchError, match="data_parallel_rank"):
        model(x, torch.zeros(4, 1))
    with pytest.raises(PipelineError, match="micro-batches"):
        model(torch.randn(3, D), torch.zeros(3, 1))
    return {"losses": result["losses"], "held": held}


@pytest.mark.parametrize("world, micros", [(2, None), (4, 4)])
def test_pipeline_block_list_trains_like_plain_pytorch(world: int, micros: int | None) -> None:
    results = run_distributed(_train_body, world, micros)
    stage_blocks = [[0, 1, 2], [3, 4]]
    for rank, got in enumerate(results):
        stage = rank // (world // 2)
        assert got["held"] == {"own": stage_blocks[stage], "layer_ids": stage_blocks[stage]}, (rank, got)
    assert all(r["losses"] == results[0]["losses"] for r in results)


# ---- init_parameters and bmt.save across stages (BMTrain's test_init_parameters_multi_gpu, pipe_size=2) ----
class _LinearInit(bmt.DistributedModule):
    """BMTrain's Linear_BMTInitializer: parameters drawn by init_method when bmt.init_parameters runs."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = bmt.DistributedParameter(torch.empty(d_out, d_in), init_method=nn.init.xavier_normal_)
        self.bias = bmt.DistributedParameter(torch.empty(d_out), init_method=nn.init.zeros_)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _LinearPipeline(bmt.DistributedModule):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.l = bmt.PipelineTransformerBlockList([_LinearInit(d_in, d_out), _LinearInit(d_in, d_out)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x)


def _init_save_body(directory: str) -> bool:
    use_pipeline(2)
    shape = (3, 5)
    torch.manual_seed(33)  # BMTrain's Linear_NormalList: xavier_normal_ weights, zero biases, in order
    ref = {}
    for i in range(2):
        ref[f"l.{i}.weight"] = nn.init.xavier_normal_(torch.empty(shape[1], shape[0]))
        ref[f"l.{i}.bias"] = torch.zeros(shape[1])
    torch.manual_seed(33)
    model = _LinearPipeline(*shape)
    bmt.init_parameters(model)
    path = os.path.join(directory, "pipe.pt")
    bmt.save(model, path)
    state = model.state_dict()
    same_state = all(torch.equal(state[k], v) for k, v in ref.items())
    if bmt.rank() != 0:
        return same_state
    saved = torch.load(path)
    return same_state and list(saved) == list(ref) and all(torch.equal(saved[k], v) for k, v in ref.items())


def test_init_parameters_and_save_hold_every_stages_blocks(tmp_path) -> None:
    assert run_distributed(_init_save_body, 2, str(tmp_path)) == [True, True]
