"""``init_parameters``: give sharded (possibly meta-device) parameters the values construction would have.

Construction is replayed one module at a time, in ``model.modules()`` order, on full temporaries of that
module's own parameters (the only full tensors alive), each rank keeping its slices:

- a ``DistributedParameter`` with an ``init_method`` (BMTrain's API) runs it;
- a module with ``reset_parameters()`` (every ``torch.nn`` layer) runs it: ``torch.manual_seed(s);
  init_parameters(model)`` then equals ``torch.manual_seed(s); Model()`` when that is the construction's
  only use of the RNG;
- a ``transformers`` model replays its construction: its submodules' ``reset_parameters`` (pre-order),
  then its own ``_init_weights`` pass (``initialize_weights``), nested models first, as ``post_init`` does.
  That pass also rebuilds non-persistent buffers lost on meta (rotary ``inv_freq``, BERT's ``position_ids``);
- ``init_fn(module)``, when given, replaces all of this for every module.

A tied parameter takes its value at its first name (``named_parameters`` order), as after construction;
initialisations reached through other names still draw their random numbers but are discarded.
Anything left unset raises ``InitError`` naming it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..base._compat import hf_initialize_weights, hf_initialize_weights_replaced, tensor_version
from ..errors import InitError, UnsupportedError
from ..job.distributed import get_state
from ..job.tp_values import list_expert, local_value, whole_shape
from ..runtime.flat_buffer import FlatBuffer
from ..runtime.module_params import installed, registrations
from ..runtime.offload import release_pages
from ..runtime.param import DistributedParameter

Temps = dict[str, nn.Parameter]


@torch.no_grad()
def init_parameters(model: nn.Module, init_fn: Callable[[nn.Module], Any] | None = None) -> None:
    """Initialise every parameter of ``model`` (sharded or not, meta or not) as construction would have.

    ``init_fn(module)``: called for each module (``model.modules()`` order) with that module's own
    parameters installed as full tensors, instead of ``reset_parameters``/``_init_weights``. Peak extra
    memory: one module's parameters.
    """
    listed = next((n for n, p in model.named_parameters() if list_expert(p)), None)
    if listed is not None:  # each EP rank would draw its own experts from the same random stream
        raise UnsupportedError(f"init_parameters of experts held as a ModuleList under ep_size= ({listed}) is not "
                               "built yet: initialise the model before wrapping, or load its weights (bmt.load)")
    replay = _Replay(model)
    for buffer in replay.buffers:
        buffer.materialize(replay.device)
    if init_fn is not None:
        for module in model.modules():
            replay.run(module, "init_fn", lambda temps, m=module: init_fn(m))
    else:
        replay.check_reproducible()
        for m in model.modules():
            m.__dict__.pop("_is_hf_initialized", None)  # replay even a model that was initialised before
        replay.construct(model)
    replay.check_complete()


@torch.no_grad()
def rebuild_lost_buffers(model: nn.Module) -> None:
    """Rebuild buffers still on the meta device (non-persistent ones are never in a file) without touching
    parameters or the RNG; ``transformers`` models through ``_init_weights``, else ``InitError`` names them."""
    replay = _Replay(model)
    for module in model.modules():
        owner = replay.hf_owner.get(id(module))
        if owner is not None and any(b is not None and b.is_meta for b in module._buffers.values()):
            with torch.random.fork_rng(devices=[]):
                replay.run(module, "_init_weights", lambda temps, m=module, o=owner: o._init_weights(m),
                           write_params=False)
    replay.check_buffers("after loading (non-persistent buffers are not saved); build the model with real "
                         "buffers, or call bmt.init_parameters(model) before bmt.load")


def _pretrained_class() -> type | None:
    # Only a model built by transformers can be one, so never import it ourselves.
    module = sys.modules.get("transformers")
    return getattr(module, "PreTrainedModel", None) if module is not None else None


class _Replay:
    """Per-module initialisation on full temporaries, and the bookkeeping of what got set."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.device = get_state().device
        self.names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self.canonical: dict[int, tuple[int, str]] = {}  # id(param) -> (id(module), attr) of its first name
        self.params: dict[int, tuple[str, nn.Parameter]] = {}
        for name, m, attr, p in registrations(model):
            if id(p) not in self.canonical:
                self.canonical[id(p)] = (id(m), attr)
                self.params[id(p)] = (name, p)
        buffers = {id(p.flat_buffer): p.flat_buffer for _, p in self.params.values()
                   if isinstance(p, DistributedParameter)}
        self.buffers: list[FlatBuffer] = list(buffers.values())
        self.done: set[int] = set()
        pretrained = _pretrained_class()
        self.hf_owner: dict[int, Any] = {}  # id(module) -> the transformers model whose _init_weights covers it
        if pretrained is not None:
            self._find_owners(model, None, pretrained)

    def _find_owners(self, module: nn.Module, owner: Any, pretrained: type) -> None:
        owner = module if isinstance(module, pretrained) else owner
        if owner is not None:
            self.hf_owner[id(module)] = owner
        for child in module.children():
            self._find_owners(child, owner, pretrained)

    def where(self, module: nn.Module) -> str:
        """A module's name and class, for messages."""
        return f"{self.names.get(id(module)) or '<root>'!r} ({type(module).__name__})"

    # ---- construction order ------------------------------------------------------------------------
    def construct(self, module: nn.Module, seen: set[int] | None = None) -> None:
        """Replay ``module``'s construction: own initialisation first, then children; a transformers model
        ends with its ``_init_weights`` pass (its ``post_init``)."""
        seen = set() if seen is None else seen
        if id(module) in seen:
            return
        seen.add(id(module))
        self.init_own(module)
        for child in module.children():
            self.construct(child, seen)
        pretrained = _pretrained_class()
        if pretrained is not None and isinstance(module, pretrained):
            self.hf_pass(module)

    def init_own(self, module: nn.Module) -> None:
        """``init_method``s of its own sharded parameters, then its ``reset_parameters``."""
        methods = {a: p._init_method for a, p in module._parameters.items()
                   if isinstance(p, DistributedParameter) and p._init_method is not None}
        if methods:
            self.run(module, "init_method", lambda temps: [f(temps[a]) for a, f in methods.items()],
                     only=set(methods))
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            rest = {a for a, p in module._parameters.items() if p is not None and a not in methods}
            self.run(module, "reset_parameters", lambda temps: reset(), only=rest)

    def hf_pass(self, pretrained: Any) -> None:
        """``pretrained.initialize_weights()``, each module's ``_init_weights`` run on full temporaries."""
        patched = [m for m in pretrained.modules() if id(self.hf_owner.get(id(m))) == id(m)]
        replacements = {}
        for owner in patched:
            original = hf_initialize_weights(owner)

            def initialize(module: nn.Module, is_custom_code: bool = False, _original: Any = original) -> None:
                if getattr(module, "_is_hf_initialized", False):
                    return  # done by a nested model's own pass, as during construction
                self.run(module, "_init_weights", lambda temps: _original(module, is_custom_code))

            replacements[owner] = initialize
        with hf_initialize_weights_replaced(replacements):
            pretrained.initialize_weights()

    # ---- one module on full temporaries ------------------------------------------------------------
    def run(self, module: nn.Module, what: str, call: Callable[[Temps], Any], only: set[str] | None = None,
            write_params: bool = True) -> None:
        """Install full temporaries of the parameters of ``module`` and of its direct children (transformers'
        ``_init_weights`` reaches into children, e.g. GPT-2's ``attn.c_proj``) and real storage for their meta
        buffers; run ``call`` with ``module``'s own temporaries; keep what it set. A parameter is kept at its
        first name only; ``only`` limits which of ``module``'s own attributes may be kept."""
        holders = [module, *module.children()]
        originals = [(m, a, p) for m in holders for a, p in m._parameters.items() if p is not None]
        by_param: dict[int, nn.Parameter] = {}  # one temporary per Parameter, however many names it has
        for _, _, p in originals:
            if id(p) not in by_param:
                # A TP-split parameter is drawn whole and sliced (BMTrain's rule): the model then equals one
                # built whole under the same seed, at any tensor-parallel size.
                shape = whole_shape(p) if isinstance(p, DistributedParameter) else p.shape
                by_param[id(p)] = nn.Parameter(_blank(shape, p.dtype, self.device), requires_grad=p.requires_grad)
        meta = [(m, n, b) for m in holders for n, b in m._buffers.items() if b is not None and b.is_meta]
        fresh = [_blank(b.shape, b.dtype, self.device) for _, _, b in meta]
        versions = {id(t): tensor_version(t) for t in [*by_param.values(), *fresh]}
        shards = [(b, tensor_version(b.shard)) for b in self.buffers]
        for (m, n, _), t in zip(meta, fresh, strict=True):
            m._buffers[n] = t
        try:
            with installed((m, a, by_param[id(p)]) for m, a, p in originals):
                call({a: by_param[id(p)] for m, a, p in originals if m is module})
        except InitError:
            raise
        except Exception as exc:
            raise InitError(f"{what} of {self.where(module)} failed on full tensors: {type(exc).__name__}: {exc}. "
                            "Pass init_fn= to initialise this module yourself") from exc
        finally:
            for (m, n, b), t in zip(meta, fresh, strict=True):
                if not _written(t, versions[id(t)]):
                    m._buffers[n] = b  # not rebuilt: stays meta, reported at the end
        touched = [b.group_name for b, v in shards if tensor_version(b.shard) != v]
        if touched:
            raise InitError(f"{what} of {self.where(module)} wrote into parameters of modules below its children "
                            f"(groups {touched}), which are sharded: it cannot be replayed on full temporaries. "
                            "Pass init_fn= to initialise this module yourself")
        if not write_params:
            return
        for m, a, p in originals:
            t = by_param[id(p)]
            own_ok = m is not module or only is None or a in only
            has_method = m is not module and isinstance(p, DistributedParameter) and p._init_method is not None
            if (own_ok and not has_method and _written(t, versions[id(t)])
                    and self.canonical.get(id(p)) == (id(m), a)):
                _adopt(p, t)
                self.done.add(id(p))

    # ---- verdicts ------------------------------------------------------------------------------------
    def check_reproducible(self) -> None:
        """Before drawing anything: modules outside transformers whose parameters nothing would set."""
        bad = []
        for m in self.model.modules():
            if id(m) in self.hf_owner or callable(getattr(m, "reset_parameters", None)):
                continue
            attrs = [a for a, p in m._parameters.items() if p is not None
                     and not (isinstance(p, DistributedParameter) and p._init_method is not None)
                     and self.canonical.get(id(p)) == (id(m), a)]
            if attrs:
                bad.append(f"{self.where(m)} parameters {attrs}")
        if bad:
            raise InitError("cannot reproduce the construction-time initialisation of " + "; ".join(bad[:5])
                            + ": no reset_parameters() sets them. Pass init_parameters(model, init_fn=...), called "
                            "with each module and its parameters as full tensors, or give them an init_method")

    def check_complete(self) -> None:
        """Every parameter set, no buffer left on the meta device."""
        unset = [name for pid, (name, _) in self.params.items() if pid not in self.done]
        if unset:
            raise InitError(f"parameters {unset[:8]}{' ...' if len(unset) > 8 else ''} were not set by any "
                            "init_method, reset_parameters(), _init_weights or init_fn: pass an init_fn that "
                            "sets them")
        self.check_buffers("after init_parameters: nothing rebuilt them; set them in init_fn")

    def check_buffers(self, why: str) -> None:
        """Raise ``InitError`` naming every buffer still on the meta device."""
        lost = [f"{n}.{b}" if n else b for n, m in self.model.named_modules()
                for b, t in m._buffers.items() if t is not None and t.is_meta]
        if lost:
            raise InitError(f"buffers {lost[:8]}{' ...' if len(lost) > 8 else ''} are still on the meta device {why}")


def _blank(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A temporary whose untouched state is recognisable by value: NaN for floating types, since writes
    through ``.data`` (``p.data.normal_()``) leave ``_version`` unchanged; others only by ``_version``."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    return t


def _written(t: torch.Tensor, version: int) -> bool:
    """Whether an initialisation wrote into ``t`` (a ``_blank``), in place or through ``.data``."""
    if tensor_version(t) != version:
        return True
    return (t.is_floating_point() or t.is_complex()) and not bool(torch.isnan(t).all())


def _adopt(p: nn.Parameter, full: torch.Tensor) -> None:
    """Give ``p`` (sharded: its slice of) the value ``full``, keeping the Parameter object."""
    if isinstance(p, DistributedParameter):
        p.load_full(local_value(p, full))
        release_pages(p.to_local())  # offloaded: written to its file, out of memory again
    elif p.is_meta:
        torch.utils.swap_tensors(p, type(p)(full.detach(), requires_grad=p.requires_grad))
    else:
        p.detach().copy_(full)
