"""BMTrain's tensor-parallel tests after the import swap (issue 28): ``tests/test_column_parallel_linear.py``
and ``tests/test_row_parallel_linear.py`` of OpenBMB/BMTrain, step for step, with ``.cuda()`` mapped to the
CPU and run on 4 ranks (tp 2 x dp 2; BMTrain ran them on 2). Each body does what the BMTrain test does
(Block-wrapped layer, ``init_parameters``, backward of ``y.sum()``, ``bmt.save`` to a ``.ckp`` file that
``torch.load`` reads into a plain ``torch.nn.Linear``) and asserts what it asserts, with its tolerances.
The one change: gradients are read with ``full_tensor()``, since our ``.grad`` is the dp-sharded
gradient of the TP slice, where BMTrain's holds this rank's ZeRO range.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dist_harness import COMM_TIMEOUT, run_distributed

import bmt_wrap as bmt
from bmt_wrap.global_var import config


def _bmt_grad(layer: torch.nn.Module, name: str) -> torch.Tensor:
    return layer._parameters[name].grad.full_tensor()


# ---- test_column_parallel_linear.py --------------------------------------------------------------------------
def _column_run_bmt(x, gather_input, gather_output, ckp_path):  # noqa: ANN001, ANN202 - BMTrain's signature
    linear = bmt.nn.ColumnParallelLinear(8, 8, gather_input=gather_input, gather_output=gather_output)
    linear = bmt.Block(linear)
    bmt.init_parameters(linear)
    y = linear(x)
    y.sum().backward()
    bmt.save(linear, ckp_path)
    bmt.synchronize()
    return y, _bmt_grad(linear, "weight"), _bmt_grad(linear, "bias")


def _run_torch(x, ckp_path):  # noqa: ANN001, ANN202
    linear = torch.nn.Linear(8, 8)
    linear_dict = torch.load(ckp_path)
    linear.load_state_dict(linear_dict)
    linear.weight.requires_grad_()
    y = linear(x)
    y.sum().backward()
    return y, linear.weight.grad, linear.bias.grad


def _column_body(gather_input: bool, gather_output: bool, ckp_path: str) -> None:
    bmt.init_distributed(seed=0, backend="gloo", timeout=COMM_TIMEOUT, tp_size=2)
    torch.manual_seed(100)
    tp_size = config["tp_size"]
    tp_rank = config["topology"].tp_id
    x = torch.randn(8, 8, 8)
    bmt_x = x.clone()
    rank_x = bmt_x.chunk(tp_size, dim=0)[tp_rank] if gather_input else bmt_x
    rank_x.requires_grad_()
    x.requires_grad_()
    y1, weight_grad1, bias_grad1 = _column_run_bmt(rank_x, gather_input, gather_output, ckp_path)
    y2, weight_grad2, bias_grad2 = _run_torch(x, ckp_path)
    if gather_output:
        assert np.allclose(y1.detach().numpy(), y2.detach().numpy())
    else:
        torch_out_list = torch.split(y2, y2.size()[-1] // tp_size, dim=-1)
        assert np.allclose(y1.detach().numpy(), torch_out_list[tp_rank].detach().numpy())
    weight_grad_list = weight_grad2.chunk(tp_size, dim=0)
    assert np.allclose(weight_grad1.reshape(weight_grad_list[tp_rank].shape).numpy(),
                       weight_grad_list[tp_rank].numpy())
    bias_grad_list = bias_grad2.chunk(tp_size, dim=0)
    assert np.allclose(bias_grad1.reshape(bias_grad_list[tp_rank].shape).numpy(), bias_grad_list[tp_rank].numpy())
    if gather_input:
        x_grad_list = x.grad.chunk(tp_size, dim=0)
        np.testing.assert_allclose(rank_x.grad.numpy(), x_grad_list[tp_rank].numpy(), atol=1e-4, rtol=1e-4)
    else:
        np.testing.assert_allclose(rank_x.grad.numpy(), x.grad.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("gather_input", "gather_output"), [(True, True), (True, False), (False, True)],
                         ids=["test_gather_output", "test_no_gather_output", "test_no_gather_input"])
def test_column_parallel_linear(gather_input: bool, gather_output: bool, tmp_path: object) -> None:
    run_distributed(_column_body, 4, gather_input, gather_output, str(tmp_path / "linear.ckp"))  # type: ignore[operator]


# ---- test_row_parallel_linear.py ------------------------------------------------------------------------------
def _row_run_bmt(x, ckp_path, split_input=True, use_checkpoint_block=True):  # noqa: ANN001, ANN202
    linear = bmt.nn.RowParallelLinear(8, 8, split_input=split_input, all_reduce_output=True)
    if use_checkpoint_block:
        linear = bmt.Block(linear)
    bmt.init_parameters(linear)
    y = linear(x)
    y.sum().backward()
    bmt.save(linear, ckp_path)
    bmt.synchronize()
    return y, _bmt_grad(linear, "weight"), _bmt_grad(linear, "bias")


def _row_body(split_input: bool, use_checkpoint_block: bool, ckp_path: str) -> None:
    bmt.init_distributed(seed=0, backend="gloo", timeout=COMM_TIMEOUT, tp_size=2)
    tp_size = bmt.config["tp_size"]
    torch.manual_seed(100)
    tp_rank = config["topology"].tp_id
    x = torch.randn(8, 8).requires_grad_()
    rank_x = x.chunk(tp_size, dim=0 if split_input else 1)[tp_rank]
    y1, weight_grad1, bias_grad1 = _row_run_bmt(rank_x, ckp_path, split_input, use_checkpoint_block)
    y2, weight_grad2, bias_grad2 = _run_torch(x, ckp_path)
    np.testing.assert_allclose(y1.detach().numpy(), y2.detach().numpy(), atol=1e-5)
    weight_grad_list = weight_grad2.chunk(tp_size, dim=1)
    assert np.allclose(weight_grad1.reshape(weight_grad_list[tp_rank].shape).numpy(),
                       weight_grad_list[tp_rank].numpy())
    assert np.allclose(bias_grad1.numpy(), bias_grad2.numpy())


@pytest.mark.parametrize("split_input", [True, False], ids=["test_split_input", "test_no_split_input"])
@pytest.mark.parametrize("use_checkpoint_block", [False, True])
def test_row_parallel_linear(split_input: bool, use_checkpoint_block: bool, tmp_path: object) -> None:
    run_distributed(_row_body, 4, split_input, use_checkpoint_block,
                    str(tmp_path / "row_parallel_linear.ckp"))  # type: ignore[operator]


# ---- BMTrain's own files, unchanged but for the import swap and the CPU ---------------------------------------
BMTRAIN_SRC = os.environ.get("BMTRAIN_SRC")  # a checkout of OpenBMB/BMTrain
SWAP = [("import bmtrain as bmt", "import bmt_wrap as bmt"), ("from bmtrain.", "from bmt_wrap."),
        (", device='cuda'", ""), ("device='cuda'", ""), (".cuda()", ""), ("torch.cuda.manual_seed", "torch.manual_seed")]


@pytest.mark.skipif(BMTRAIN_SRC is None, reason="needs BMTrain's source: set BMTRAIN_SRC to a checkout of "
                    "OpenBMB/BMTrain (the ports above check the same on every run)")
@pytest.mark.parametrize("name", ["test_column_parallel_linear", "test_row_parallel_linear"])
def test_bmtrains_own_file_runs_after_the_import_swap(name: str, tmp_path: Path) -> None:
    """BMTrain's file as its ``__main__`` runs it (tp_size=2 on 2 ranks), through torchrun."""
    source = (Path(BMTRAIN_SRC) / "tests" / f"{name}.py").read_text()  # type: ignore[arg-type]
    for old, new in SWAP:
        source = source.replace(old, new)
    (tmp_path / f"{name}.py").write_text(source)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(port), f"{name}.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
