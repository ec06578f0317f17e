"""torch.distributed.checkpoint (DCP) on wrapped models: ``get_state_dict``/``set_state_dict`` give a sharded
checkpoint (each rank writes its own elements) that loads at the same world size bit-exactly, at another
world size and into a plain model; ``LocalShard``'s boxes cover exactly a rank's elements."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_harness import run_distributed
from hypothesis import given, settings
from hypothesis import strategies as st
from models import gpt2, llama, token_ids
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import bmt_wrap as bmt
from bmt_wrap.checkpoint.local_shard import LocalShard, flat_range_boxes
from bmt_wrap.errors import CheckpointError

BUILD = {"llama": llama, "gpt2": gpt2}
STEPS_BEFORE_SAVE = 2


# ---- LocalShard on its own ---------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=4), data=st.data())
def test_boxes_cover_exactly_the_flat_range_in_order(shape: list[int], data: st.DataObject) -> None:
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    end = data.draw(st.integers(start, numel))
    full = torch.arange(numel).reshape(shape)
    pieces = []
    for offsets, sizes, first in flat_range_boxes(tuple(shape), start, end):
        assert len(offsets) == len(sizes) == len(shape)
        box = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
        assert torch.equal(box.reshape(-1), torch.arange(first, first + box.numel())), "a box is contiguous"
        pieces.append(box.reshape(-1))
    got = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)
    assert torch.equal(got, torch.arange(start, end)), "boxes cover [start, end) once, in order"
    assert len(pieces) <= max(1, 2 * len(shape) - 1)


def test_local_shard_reports_the_full_size_and_pickles_as_its_local_elements() -> None:
    local = torch.arange(5.0)
    shard = LocalShard.of(local, (3, 4), 6)
    assert shard.size() == torch.Size([3, 4]) and shard.shape == torch.Size([3, 4])
    assert torch.equal(shard.local(), local) and shard.local().data_ptr() == local.data_ptr()
    back = pickle.loads(pickle.dumps(shard))
    assert type(back) is torch.Tensor and torch.equal(back, local)
    assert type(shard + 1) is torch.Tensor, "ops see plain local elements"
    with pytest.raises(ValueError, match="does not fit"):
        LocalShard.of(torch.zeros(7), (3, 4), 6)


# ---- on ranks ----------------------------------------------------------------------------------------------
def _batch(step: int) -> torch.Tensor:
    """This rank's slice of the global batch of four sequences for ``step``."""
    return token_ids(batch=4, seed=100 + step).chunk(bmt.world_size())[bmt.rank()]


def _global_loss(model: torch.nn.Module, step: int) -> float:
    """The global batch's mean loss with the current parameters (every rank holds an equal slice)."""
    ids = _batch(step)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.reshape(1)
    if bmt.world_size() > 1:
        dist.all_reduce(loss)
    return float(loss) / bmt.world_size()


def _setup(name: str, optimizer: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = bmt.BMTrainModelWrapper(BUILD[name]())
    if optimizer == "torch":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    ids = _batch(step)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Whole model and optimizer state through DCP's own full-state-dict option (CPU)."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    cpu = {k: v.detach().cpu() for k, v in msd.items()}
    ocpu = {fqn: {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for fqn, s in osd["state"].items()}
    return cpu, ocpu


def _save_body(tmp: str, name: str, optimizer: str) -> dict:
    model, opt = _setup(name, optimizer)
    for step in range(STEPS_BEFORE_SAVE):
        _step(model, opt, step)
    msd, osd = get_state_dict(model, opt)
    sharded = [k for k, v in msd.items() if isinstance(v, LocalShard)]
    assert sharded, "DCP's sharded state dict holds LocalShards, nothing gathered"
    assert any(isinstance(v, LocalShard) for s in osd["state"].values() for v in s.values())
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp)
    full_model, full_optim = _full(model, opt)
    return {"full_model": full_model, "full_optim": full_optim, "next_loss": _global_loss(model, STEPS_BEFORE_SAVE)}


def _load_body(tmp: str, name: str, optimizer: str) -> dict:
    torch.manual_seed(1234)  # another init: everything must come from the checkpoint
    model, opt = _setup(name, optimizer)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=tmp)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full_model, full_optim = _full(model, opt)
    return {"full_model": full_model, "full_optim": full_optim, "next_loss": _global_loss(model, STEPS_BEFORE_SAVE)}


def _plain_load_body(tmp: str, name: str) -> dict:
    torch.manual_seed(1234)
    plain = BUILD[name]()
    sd = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    dcp.load({"model": sd}, checkpoint_id=tmp)
    return {k: v.detach() for k, v in sd.items()}


def _assert_same(saved: dict, loaded: dict, what: str) -> None:
    assert saved.keys() == loaded.keys(), what
    for k in saved:
        a, b = saved[k], loaded[k]
        if isinstance(a, dict):
            _assert_same(a, b, f"{what} {k}")
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b), f"{what}: {k} differs after the round trip"
        else:
            assert a == b, f"{what}: {k} = {b}, saved {a}"


@pytest.mark.parametrize("name,optimizer", [("llama", "torch"), ("gpt2", "ours")])
def test_dcp_checkpoint_is_sharded_and_loads_at_2_and_4_ranks_and_into_a_plain_model(
        tmp_path: Path, name: str, optimizer: str) -> None:
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(_save_body, 2, ckpt, name, optimizer)[0]
    files = sorted(Path(ckpt).glob("*.distcp"))
    sizes = [f.stat().st_size for f in files]
    assert len(files) == 2 and min(sizes) > 0.3 * max(sizes), f"each rank wrote its own elements: {sizes}"
    for world in (2, 4):
        loaded = run_distributed(_load_body, world, ckpt, name, optimizer)
        for r, got in enumerate(loaded):
            _assert_same(saved["full_model"], got["full_model"], f"model at {world} ranks (rank {r})")
            _assert_same(saved["full_optim"], got["full_optim"], f"optimizer at {world} ranks (rank {r})")
        if world == 2:
            assert loaded[0]["next_loss"] == saved["next_loss"], "same world size: the next step is bit-exact"
        else:
            assert loaded[0]["next_loss"] == pytest.approx(saved["next_loss"], rel=1e-5)
    plain = run_distributed(_plain_load_body, 1, ckpt, name)[0]
    for k, v in plain.items():
        assert torch.equal(v, saved["full_model"][k]), f"a plain model loads {k} whole"


def _per_rank_torch_save_body(tmp: str) -> list[float]:
    model, opt = _setup("llama", "torch")
    _step(model, opt, 0)
    path = Path(tmp) / f"optim-{bmt.rank()}.pt"
    torch.save(opt.state_dict(), path)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, opt, 1)
    straight = _global_loss(model, 2)
    torch.manual_seed(99)
    model2, opt2 = _setup("llama", "torch")
    model2.load_state_dict(weights)
    opt2.load_state_dict(torch.load(path, weights_only=True))
    _step(model2, opt2, 1)
    return [straight, _global_loss(model2, 2)]


def test_per_rank_torch_save_of_the_optimizer_still_resumes_exactly(tmp_path: Path) -> None:
    for straight, resumed in run_distributed(_per_rank_torch_save_body, 2, str(tmp_path)):
        assert straight == resumed


def _wrong_range_body() -> str:
    model, opt = _setup("llama", "torch")
    _step(model, opt, 0)
    osd = opt.state_dict()
    pid, state = next((pid, s) for pid, s in osd["state"].items()
                      if isinstance(s.get("exp_avg"), LocalShard) and s["exp_avg"].local().numel() > 0)
    shard = state["exp_avg"]
    moved = LocalShard.of(shard.local()[1:], shard.full_shape, shard.start + 1)  # another rank's range
    osd["state"][pid] = {**state, "exp_avg": moved}
    with pytest.raises(CheckpointError, match="through torch.distributed.checkpoint"):
        opt.load_state_dict(osd)
    return "raised"


def test_a_local_shard_of_another_range_is_refused_by_name() -> None:
    assert run_distributed(_wrong_range_body, 2) == ["raised", "raised"]
