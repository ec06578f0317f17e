"""Mixture-of-experts layers found by structure, and their experts' placement over expert-parallel ranks
(pure, one process): the plan's experts section (``base/expert_plan.py``).

A layer is a module with two children: **experts**, either packed (direct parameters only, every one with
the same leading size E >= 2 and at least one 3-D: transformers' Mixtral, Qwen-MoE, DeepSeek-V3, gpt-oss)
or a ModuleList/ModuleDict of E >= 2 expert MLPs of one structure; and a **router**, a sibling holding a
2-D weight with E rows (one score per expert). No class or model name is read. Structure only suggests a
layer; a probe confirms it: a meta copy of the layer runs on two meta tokens until it calls its experts,
and the call must hand them the tokens ``[tokens, hidden]``, integer top-k indices ``[tokens, k]`` with
k < E and their weights ``[tokens, k]`` (transformers' Experts interface). Anything else stays dense, with
the reason: a router that hands its experts a one-hot dispatch mask (Switch Transformers), a forward that
fails on meta tensors or never calls its experts. The layer's other children (shared experts and their
gates) stay dense. Every rank runs this pass on the same model, so its errors are raised alike everywhere.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from ..base.dtypes import dtype_name
from ..base.expert_plan import DenseLayer, ExpertPlan, MoELayer
from ..base.tp_plan import TensorParallelPlan
from ..errors import ExpertParallelError, listed
from .capture import meta_skeleton
from .signature import SignatureCache

#: Tokens the probe routes: two, so a top-k's shape tells k from the token count.
PROBE_TOKENS = 2
# An int attribute of an experts module whose name says it counts the experts (transformers' Experts
# interface: ``num_experts``); only one equal to the count found is taken.
_EXPERT_COUNT = re.compile(r"^(n|num)_(local_|routed_)?experts$")


class _ExpertsCalled(Exception):
    """Stops the probe at the experts' call, carrying its arguments."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("experts called")
        self.args, self.kwargs = args, kwargs


def plan_experts(model: nn.Module, ep_size: int = 1, shard_size: int | None = None) -> ExpertPlan:
    """The experts section of ``model``'s plan for ``ep_size`` expert-parallel ranks borrowed from
    ``shard_size`` (None: any); raises ``ExpertParallelError`` when ``ep_size > 1`` finds no MoE layer, does
    not divide a layer's experts (suggesting sizes that divide them and ``shard_size``), or a layer's expert
    weight is shared with a module outside its experts."""
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1:
        raise ExpertParallelError(f"ep_size must be a positive int, got {ep_size!r}")
    section = ExpertPlan(ep_size=ep_size)
    owners = _owners(model)
    sig = SignatureCache()
    for name, module in model.named_modules():
        found = _structure(module, sig)
        if found is None:
            continue
        experts_name, router_name, layout, num = found
        full = f"{name}.{experts_name}" if name else experts_name
        reason = _shared_outside(full, module.get_submodule(experts_name), owners) or None
        layer = None
        if reason is None:
            layer, reason = _probe(model, name, module, experts_name, router_name, layout, num)
        if layer is None:
            section.dense.append(DenseLayer(module=name, reason=reason or "not a mixture of experts"))
        else:
            section.layers.append(layer)
    if ep_size > 1:
        _check_split(model, section, shard_size)
    return section


def check_tp_split(section: ExpertPlan, tp: TensorParallelPlan | None) -> None:
    """Raise ``ExpertParallelError`` when the tensor-parallel section ``tp`` splits an expert weight: expert
    parallelism places whole experts (the wrapper and ``bmt-wrap plan --ep-size --tp-size`` alike)."""
    every = {n for la in section.layers for n in la.local_params(la.num_experts)}
    split = sorted(every & tp.split_names()) if tp is not None else []
    if split:
        raise ExpertParallelError(f"ep_size={section.ep_size}: the tensor-parallel plan splits expert weight "
                                  f"{split[0]}; expert parallelism places whole experts: leave the experts out "
                                  "of tp_plan=")


def _owners(model: nn.Module) -> dict[int, list[str]]:
    """Every parameter's names (tied aliases included), by the parameter's identity."""
    out: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(n)
    return out


def _structure(module: nn.Module, sig: SignatureCache) -> tuple[str, str, str, int] | None:
    """(experts child, router child, layout, E) when ``module``'s children look like a MoE layer."""
    children = dict(module.named_children())
    for experts_name, child in children.items():
        layout, num = _experts_layout(child, sig)
        if layout is None:
            continue
        routers = [n for n, c in children.items() if n != experts_name and _scores(c, num)]
        if len(routers) == 1:
            return experts_name, routers[0], layout, num
    return None


def _experts_layout(module: nn.Module, sig: SignatureCache) -> tuple[str | None, int]:
    """("packed", E), ("list", E) or (None, 0): how ``module`` holds E experts, if it looks like it does."""
    own = list(module.parameters(recurse=False))
    kids = list(module.children())
    if own and not any(True for c in kids for _ in c.parameters()):
        leads = {p.shape[0] if p.ndim >= 2 else None for p in own}
        if len(leads) == 1 and None not in leads and min(leads) >= 2 and any(p.ndim == 3 for p in own):
            return "packed", own[0].shape[0]
    if (isinstance(module, (nn.ModuleList, nn.ModuleDict)) and not own and len(kids) >= 2
            and len({sig(c) for c in kids}) == 1 and any(True for _ in kids[0].parameters())):
        return "list", len(kids)
    return None, 0


def _scores(module: nn.Module, num: int) -> bool:
    """True when ``module`` holds a 2-D weight with one row per expert (a router's scores)."""
    return any(p.ndim == 2 and p.shape[0] == num for p in module.parameters())


def _shared_outside(experts: str, module: nn.Module, owners: dict[int, list[str]]) -> str:
    """Why the experts cannot be placed apart: a parameter also reachable outside them ('' if none)."""
    for rel, p in module.named_parameters():
        outside = [n for n in owners[id(p)] if not n.startswith(f"{experts}.")]
        if outside:
            return (f"expert weight {experts}.{rel} is the same Parameter as {listed(outside, 3)}, outside the "
                    "experts: an expert's owner alone could not update it")
    return ""


def _probe(model: nn.Module, name: str, module: nn.Module, experts_name: str, router_name: str, layout: str,
           num: int) -> tuple[MoELayer | None, str]:
    """Run a meta copy of the layer until it calls its experts; the layer, or None and why it stays dense."""
    router = module.get_submodule(router_name)
    weight = next(p for p in router.parameters() if p.ndim == 2 and p.shape[0] == num)
    hidden = weight.shape[1]
    experts = module.get_submodule(experts_name)
    dtype = next(experts.parameters()).dtype
    skeleton = meta_skeleton(module)
    target = skeleton.get_submodule(experts_name)

    def stop(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        raise _ExpertsCalled(args, kwargs)

    handle = target.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with torch.no_grad():
            skeleton(torch.zeros(1, PROBE_TOKENS, hidden, dtype=dtype, device="meta"))
    except _ExpertsCalled as called:
        return _read_call(name, module, experts_name, router_name, layout, num, hidden, called)
    except Exception as exc:  # any: the layer stays dense, and says why
        return None, (f"a meta-device run of the layer failed before its experts were called "
                      f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    finally:
        handle.remove()
    return None, f"its forward never called {experts_name}"


def _read_call(name: str, module: nn.Module, experts_name: str, router_name: str, layout: str, num: int,
               hidden: int, called: _ExpertsCalled) -> tuple[MoELayer | None, str]:
    """The layer, when the experts' call is (tokens, top-k indices, top-k weights)."""
    if called.kwargs:
        return None, f"{experts_name} is called with keyword arguments ({', '.join(called.kwargs)})"
    tensors = [a for a in called.args if isinstance(a, torch.Tensor)]
    if len(tensors) != len(called.args) or len(tensors) != 3:
        return None, f"{experts_name} is called with {len(called.args)} argument(s), not (tokens, indices, weights)"
    x, idx, w = tensors
    if idx.is_floating_point() or idx.dtype == torch.bool or idx.ndim != 2:
        return None, (f"its router hands {experts_name} a {dtype_name(idx.dtype)} tensor of shape "
                      f"{list(idx.shape)}, not top-k expert indices [tokens, k]")
    k = idx.shape[-1]
    if not 1 <= k < num:
        return None, (f"its router hands {experts_name} {k} indices per token for {num} experts: a dispatch "
                      "mask over every expert, not top-k indices")
    if list(x.shape) != [idx.shape[0], hidden] or list(w.shape) != list(idx.shape) or not w.is_floating_point():
        return None, (f"{experts_name} is called with shapes {[list(t.shape) for t in tensors]}, not tokens "
                      f"[n, {hidden}], indices [n, k] and weights [n, k]")
    prefix = f"{name}." if name else ""
    experts = module.get_submodule(experts_name)
    params = {f"{prefix}{experts_name}.{n}": list(p.shape) for n, p in experts.named_parameters()}
    if layout == "list":  # one expert per child: the full shape has the experts in front
        params = {n: [num, *s] for n, s in _stacked(experts).items()}
        params = {f"{prefix}{experts_name}.{n}": s for n, s in params.items()}
    nbytes = sum(p.numel() * p.element_size() for p in experts.parameters())
    dense = [n for n, c in module.named_children() if n not in (experts_name, router_name)
             and any(True for _ in c.parameters())]
    return MoELayer(module=name, router=f"{prefix}{router_name}", experts=f"{prefix}{experts_name}", layout=layout,
                    num_experts=num, top_k=k, hidden=hidden, activation_dtype=dtype_name(x.dtype), params=params,
                    expert_bytes=nbytes, dense=[f"{prefix}{n}" for n in dense],
                    counts=sorted(a for a, v in vars(experts).items()
                                  if _EXPERT_COUNT.match(a) and isinstance(v, int) and v == num)), ""


def _stacked(experts: nn.Module) -> dict[str, list[int]]:
    """A list of experts' parameters by their name inside one expert (``*`` for the expert's key)."""
    first = next(iter(experts.children()))
    return {f"*.{n}": list(p.shape) for n, p in first.named_parameters()}


def _check_split(model: nn.Module, section: ExpertPlan, shard_size: int | None) -> None:
    """The errors expert parallelism raises before anything changes (every rank runs this alike)."""
    e, what = section.ep_size, type(model).__name__
    shared = [d for d in section.dense if d.reason.startswith("expert weight ")]
    if shared:
        raise ExpertParallelError(f"ep_size={e}: in {what}.{shared[0].module}, {shared[0].reason}. Untie it "
                                  "(give the experts their own copy) or wrap without ep_size")
    if not section.layers:
        why = "; ".join(f"{d.module}: {d.reason}" for d in section.dense)
        raise ExpertParallelError(
            f"ep_size={e}: no mixture-of-experts layer was found in {what} (a router whose top-k indices choose "
            "among packed 3-D expert weights or a list of expert MLPs)"
            + (f"; left dense: {why}" if why else "") + ". Wrap it without ep_size")
    bad = [layer for layer in section.layers if layer.num_experts % e]
    if bad:
        counts = listed([f"{b.module} ({b.num_experts})" for b in bad], 3, fmt=str)
        # A suggestion must also divide the ranks EP borrows from, or it fails the next wrap.
        whole = math.gcd(*(la.num_experts for la in section.layers), shard_size or 0)
        fits = [d for d in range(2, whole + 1) if whole % d == 0]
        where = f" and the {shard_size} ranks it borrows from" if shard_size else ""
        raise ExpertParallelError(f"ep_size={e} does not divide the experts of {counts}: each EP rank must own "
                                  f"the same number of each layer's experts. "
                                  + (f"Use an ep_size in {fits} (they divide every layer's experts{where})" if fits
                                     else f"No ep_size > 1 divides every layer's experts{where}: wrap without "
                                     "ep_size"))
