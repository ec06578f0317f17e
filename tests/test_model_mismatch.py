"""Ranks that built different models, or wrap with different plan=/example_inputs=, get one named error
(ModelMismatchError) on every rank, before any collective that depends on the model's shapes."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
from dist_harness import raised, run_distributed
from toy import ToyGPT, manual_plan

import bmt_wrap as bmt
from bmt_wrap.distributed import get_state

BLOCKS3 = [f"layers.{i}" for i in range(3)]
DEADLINE_S = 30  # every rank has its error within this, counted from the first rank's call


def _wrap_divergent_model(kind: str) -> tuple[str, str]:
    get_state().comm.timeout = timedelta(seconds=20)
    first = bmt.rank() == 0
    sizes = {"hidden": {"d": 16 if first else 12}, "layers": {"n_layers": 3 if first else 2}}[kind]
    torch.manual_seed(0)
    model = ToyGPT(**sizes)
    return raised(lambda: bmt.BMTrainModelWrapper(model))


def _model_mismatch_on_every_rank(body: Callable[[str], tuple[str, str]], case: str) -> list[str]:
    """Run ``body(case)`` on 2 ranks; each must raise ModelMismatchError within the deadline: the messages."""
    start = time.monotonic()
    results = run_distributed(body, 2, case, timeout=120)
    assert time.monotonic() - start < DEADLINE_S, results
    assert [name for name, _ in results] == ["ModelMismatchError", "ModelMismatchError"], results
    return [message for _, message in results]


@pytest.mark.parametrize("kind,names", [
    ("hidden", r"'wpe' \(rank 0: float32 \[32, 16\], requires_grad=True; rank 1: float32 \[32, 12\]"),
    ("layers", r"'layers.2.ln1.weight' \(rank 0: float32 \[16\], requires_grad=True; rank 1: missing\)"),
])
def test_ranks_that_built_different_models_get_one_named_error(kind: str, names: str) -> None:
    messages = _model_mismatch_on_every_rank(_wrap_divergent_model, kind)
    for message in messages:
        assert "ranks built different models" in message, message
        assert re.search(names, message), message
    assert messages[0] == messages[1]  # one message, the same on every rank


def _wrap_with_divergent_argument(which: str) -> tuple[str, str]:
    get_state().comm.timeout = timedelta(seconds=20)
    first = bmt.rank() == 0
    torch.manual_seed(0)
    model = ToyGPT()
    idx = torch.randint(0, 64, (2, 8))
    kwargs = {
        "plan-missing": {"plan": manual_plan(model, BLOCKS3)} if first else {},
        "plan-differs": {"plan": manual_plan(model, BLOCKS3, checkpoint=first)},
        "inputs-missing": {"example_inputs": ((idx,), {})} if first else {},
        "inputs-differ": {"example_inputs": ((idx,), {} if first else {"targets": idx})},
    }[which]
    return raised(lambda: bmt.BMTrainModelWrapper(model, **kwargs))


@pytest.mark.parametrize("which,says", [
    ("plan-missing", r"plan=.*rank 0: passed.*rank 1: not passed"),
    ("plan-differs", r"plan=.*plan\.groups\[\d\]\.checkpoint.*rank 0: true.*rank 1: false"),
    ("inputs-missing", r"example_inputs=.*rank 0: passed.*rank 1: not passed"),
    ("inputs-differ", r"example_inputs=.*\['targets'\].*rank 0: missing.*rank 1: int64 tensor of 2 dims"),
])
def test_wrap_arguments_that_differ_by_rank_are_named(which: str, says: str) -> None:
    messages = _model_mismatch_on_every_rank(_wrap_with_divergent_argument, which)
    assert re.search(says, messages[0]), messages[0]
    assert messages[0] == messages[1]


def _inputs_of_other_sizes() -> int:
    torch.manual_seed(0)
    model = ToyGPT()
    batch = torch.randint(0, 64, (1 + bmt.rank(), 4 + 2 * bmt.rank()))  # each rank's own batch
    model = bmt.BMTrainModelWrapper(model, example_inputs=((batch, batch), {}))
    model(batch, batch).backward()
    return len(model.plan.groups)


def test_example_inputs_may_differ_in_values_and_sizes() -> None:
    assert run_distributed(_inputs_of_other_sizes, 2) == [4, 4]


def _block_of_other_width() -> tuple[str, str]:
    from bmt_wrap.block import CheckpointBlock

    get_state().comm.timeout = timedelta(seconds=20)
    return raised(lambda: CheckpointBlock(torch.nn.Linear(4, 4 if bmt.rank() == 0 else 3)))


def test_explicit_blocks_that_differ_by_rank_are_named() -> None:
    results = run_distributed(_block_of_other_width, 2, timeout=120)
    assert [name for name, _ in results] == ["ModelMismatchError", "ModelMismatchError"], results
    assert re.search(r"CheckpointBlock 'block\d+'.*'weight' \(rank 0: float32 \[4, 4\].*rank 1: float32 \[3, 4\]",
                     results[0][1]), results
