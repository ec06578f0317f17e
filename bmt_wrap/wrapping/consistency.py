"""Facts every rank must share: the model it built, the arguments it wraps with, a checkpoint's directory.

Ranks that built different models would otherwise fail inside the first collective whose sizes follow
from the model, each with its own raw error (a size mismatch on one rank, a lost peer on the other).
Here each rank digests its facts and one small all-reduce compares the digests, before any such
collective; only when they differ are the facts themselves sent, so every rank can name the first
difference. ``check_same_wrap`` runs on every wrap, so it only formats names, shapes and dtypes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..base._compat import pytree
from ..base.dtypes import dtype_name
from ..base.plan import WrapPlan
from ..errors import ModelMismatchError
from ..job.distributed import agree, broadcast_bytes, get_state
from ..runtime.module_params import param_sites

Facts = dict[str, str]  # a name (parameter, path into a plan) -> its value on this rank, in order

MISSING = "missing"


@dataclass(frozen=True)
class Difference:
    """The first fact rank 0 and ``rank`` disagree on, and how many more they disagree on."""

    rank: int
    key: str
    ours: str  # rank 0's value
    theirs: str  # ``rank``'s value
    more: int

    def __str__(self) -> str:
        more = f", and {self.more} more difference{'s' if self.more > 1 else ''}" if self.more else ""
        return f"{self.key!r} (rank 0: {self.ours}; rank {self.rank}: {self.theirs}){more}"


def differences(facts: dict[str, Facts], what: str) -> dict[str, Difference]:
    """For each subject of ``facts`` whose facts differ between ranks, the first difference between rank 0 and
    the first rank that differs from it; the same on every rank. A collective (one all-reduce when all agree)."""
    state = get_state()
    if state.world_size == 1:
        return {}
    rows = agree(None, [_digest(f) for f in facts.values()], what=f"{what} digests")
    found = {}
    for i, (subject, mine) in enumerate(facts.items()):
        other = next((r for r, row in enumerate(rows) if row[i] != rows[0][i]), None)
        if other is not None:
            ours, theirs = (dict(json.loads(broadcast_bytes(
                json.dumps(list(mine.items())).encode() if state.rank == src else None, src).decode()))
                for src in (0, other))
            found[subject] = _first_difference(ours, theirs, other)
    return found


def check_same_wrap(model: nn.Module, plan: Any, example_inputs: Any) -> None:
    """Raise ``ModelMismatchError`` on every rank unless all ranks wrap the same model with the same
    ``plan=`` and ``example_inputs=`` of one structure; a collective."""
    found = differences({"model": module_facts(model), "plan=": _plan_facts(plan),
                         "example_inputs=": _input_facts(example_inputs)}, "wrap arguments")
    if found:
        raise ModelMismatchError(" ".join(_WRAP_ADVICE[subject].format(d) for subject, d in found.items()))


_WRAP_ADVICE = {
    "model": "The ranks built different models: {}. BMTrainModelWrapper shards one model across the ranks, so "
             "every rank must build the same one: look for sizes or layer counts that depend on the rank, the "
             "host or a file read per rank.",
    "plan=": "The ranks passed different plan= to BMTrainModelWrapper: {}. Pass the same plan on every rank "
             "(read one file everywhere), or none.",
    "example_inputs=": "The ranks passed different example_inputs= to BMTrainModelWrapper: {}. The plan is made "
                       "from rank 0's, so every rank must pass inputs of one structure and dtypes (values and "
                       "sizes may differ), or none.",
}


def check_same_block(module: nn.Module, name: str) -> None:
    """Raise ``ModelMismatchError`` on every rank unless all ranks built the same ``module`` for block ``name``."""
    found = differences({"block": module_facts(module)}, "block")
    if found:
        raise ModelMismatchError(f"The ranks built different modules for CheckpointBlock {name!r}: {found['block']}. "
                                 "Every rank must build the same blocks, in the same order: look for sizes that "
                                 "depend on the rank.")


def module_facts(module: nn.Module) -> Facts:
    """Each parameter's dtype, shape and requires_grad and each buffer's dtype and shape, by name; a tied
    parameter's other names say what they are tied to."""
    facts: Facts = {}
    for site in param_sites(module):  # a sharded parameter's full shape: its local one differs by rank
        info = site.info()
        facts[info.fqn] = f"{info.dtype} {info.shape}, requires_grad={info.requires_grad}"
        facts.update((alias, f"tied to {info.fqn!r}") for alias in info.aliases)
    facts.update((n, f"buffer {dtype_name(b.dtype)} {list(b.shape)}") for n, b in module.named_buffers())
    return facts


def _plan_facts(plan: Any) -> Facts:
    if plan is None:
        return {"plan=": "not passed"}
    if not isinstance(plan, WrapPlan):  # refused after this check, alike on every rank
        return {"plan=": f"a {type(plan).__name__}"}
    facts = {"plan=": "passed"}
    _flatten("plan", json.loads(plan.to_json(indent=None)), facts)
    return facts


def _flatten(key: str, value: Any, into: Facts) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{key}.{k}", v, into)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _flatten(f"{key}[{i}]", v, into)
    else:
        into[key] = json.dumps(value)


def _input_facts(example_inputs: Any) -> Facts:
    """The inputs' structure and each tensor's dtype and dims: each rank passes its own batch, so values and
    sizes may differ."""
    if example_inputs is None:
        return {"example_inputs=": "not passed"}
    facts = {"example_inputs=": "passed"}
    leaves, _ = pytree.tree_flatten_with_path(example_inputs)
    for path, leaf in leaves:
        facts[f"example_inputs{pytree.keystr(path)}"] = (
            f"{dtype_name(leaf.dtype)} tensor of {leaf.dim()} dims" if isinstance(leaf, torch.Tensor)
            else repr(leaf) if isinstance(leaf, bool | int | float | str | None) else type(leaf).__name__)
    return facts


def _digest(facts: Facts) -> int:
    text = "\n".join(f"{k}\t{v}" for k, v in facts.items())
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _first_difference(ours: Facts, theirs: Facts, rank: int) -> Difference:
    differing = [k for k in ours if ours[k] != theirs.get(k, MISSING)] + [k for k in theirs if k not in ours]
    key = differing[0]
    return Difference(rank, key, ours.get(key, MISSING), theirs.get(key, MISSING), len(differing) - 1)
