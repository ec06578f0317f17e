"""``AdamOptimizer``: Adam with decoupled weight decay that updates each flat shard in one fused call."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from typing import Any, NamedTuple

import torch

from ..base.dtypes import FLOATING, LOW_PRECISION
from ..errors import OptimizerError
from ..kernels import cupy_usable
from ..runtime.host_store import compute_device
from ..runtime.offload import is_offloaded, release_pages
from ..runtime.sharded_tensor import local_view
from ..save_load.optim_shards import attach_state_hooks, local_state_dict
from . import torch_adam
from .adam_math import AdamHyper
from .cupy_adam import KERNEL_DTYPES, cupy_step
from .fusion import PlanCache, plan_runs
from .grad_scaler_guard import check_no_grad_scaler
from .host_chunks import step_through_device


class _StateViews(NamedTuple):
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    master: torch.Tensor | None


def _validate(lr: float, betas: tuple[float, float], eps: float, weight_decay: float, hold_steps: int) -> None:
    problems = []
    if not lr >= 0.0:
        problems.append(f"lr={lr} must be >= 0")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        problems.append(f"betas={betas} must be two values in [0, 1)")
    if not eps >= 0.0:
        problems.append(f"eps={eps} must be >= 0")
    if not weight_decay >= 0.0:
        problems.append(f"weight_decay={weight_decay} must be >= 0")
    if hold_steps < 0:
        problems.append(f"hold_steps={hold_steps} must be >= 0")
    if problems:
        raise OptimizerError("invalid Adam hyperparameters: " + "; ".join(problems))


class AdamOptimizer(torch.optim.Optimizer):
    """Adam with decoupled weight decay for every dtype (``torch.optim.AdamW`` semantics).

    fp16/bf16 parameters keep an fp32 master copy and fp32 moments; fp32 parameters are updated in
    place. Adjacent views of one flat buffer (the engine's shards) with equal hyperparameters are
    updated by one fused call: the CuPy kernel on CUDA, ``torch._fused_adamw_`` otherwise. Parameters
    whose ``.grad`` is None are left untouched, moments included. ``hold_steps``: the first that many
    updates of each parameter use lr 0 (moments still accumulate), as in BMTrain.
    """

    #: OptimManager passes the loss scale to ``step(scale=...)``, which unscales inside the fused update.
    _bmtrain_optimizer = True
    _offload = False

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 hold_steps: int = 0) -> None:
        _validate(lr, betas, eps, weight_decay, hold_steps)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        for p in chain.from_iterable(g["params"] for g in self.param_groups):
            if p.dtype not in FLOATING:
                raise OptimizerError(f"{type(self).__name__} updates floating-point parameters only; got one of "
                                     f"dtype {p.dtype}: leave it out of the optimizer's params")
        self.hold_steps = hold_steps
        attach_state_hooks(self)  # state_dict(): sharded parameters' state as LocalShards (DCP saves per rank)
        self._views: dict[torch.Tensor, _StateViews] = {}
        self._plans = PlanCache()
        self._scratch: dict[torch.device, torch.Tensor] = {}
        #: Fused update calls (runs) made by the last step: tests and benchmarks read it.
        self.last_step_runs = 0

    # ---- where the state lives ----------------------------------------------------------------------
    def _state_device(self, p: torch.Tensor) -> torch.device:
        return torch.device("cpu") if self._offload else p.device

    def _keeps_master(self, p: torch.Tensor) -> bool:
        return self._offload or p.dtype in LOW_PRECISION

    def _zeros(self, shape: torch.Size, p: torch.Tensor) -> torch.Tensor:
        dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        # Host state of a CUDA job (ours, or beside shards offloaded to host memory): pinned for fast copies.
        home = compute_device(p)
        pin = (self._offload and torch.cuda.is_available()) or (home is not None and home.type == "cuda")
        return torch.zeros(shape, dtype=dtype, device=self._state_device(p), pin_memory=pin)

    def _layout_runs(self, placed: Iterable[torch.Tensor]) -> Iterator[tuple[torch.Tensor, list[tuple]]]:
        """Trainable parameters not in ``placed``, as runs of adjacent views of one flat buffer: each run's
        covering view and its members ``(parameter, local view, offset in the cover)``. State laid out
        the same way is adjacent too, so the step's runs fuse over it as well."""
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad and p not in placed]
        items = [(local_view(p).detach(),) for p in params]
        for run in plan_runs(items, [0] * len(items)):
            (cover,) = run.views(items)
            yield cover, [(params[i], items[i][0], items[i][0].storage_offset() - cover.storage_offset())
                          for i in run.members]

    def _reserve(self) -> None:
        """Allocate state for every trainable parameter not yet covered, mirroring the parameters' layout."""
        for cover, members in self._layout_runs(self._views):
            buffers = [self._zeros(cover.shape, cover) for _ in range(3 if self._keeps_master(cover) else 2)]
            for p, local, start in members:
                views = (buffers if len(members) == 1
                         else [b[start:start + local.numel()].view(local.shape) for b in buffers])
                self._views[p] = _StateViews(views[0], views[1], views[2] if len(views) == 3 else None)

    def _views_for(self, p: torch.Tensor) -> _StateViews:
        if p not in self._views:
            self._reserve()
        if p not in self._views:  # empty or frozen: nothing to share a buffer with
            local = local_view(p)
            self._views[p] = _StateViews(self._zeros(local.shape, p), self._zeros(local.shape, p),
                                         self._zeros(local.shape, p) if self._keeps_master(p) else None)
        return self._views[p]

    def _init_state(self, p: torch.Tensor, state: dict[str, Any], saved: dict[str, Any] | None = None) -> None:
        """Fresh state for ``p`` (moments zero, master from the parameter), or the ``saved`` one. Saved
        tensors may be these very views (loading our own state_dict), so each is copied, never zeroed first."""
        saved = saved or {}
        views = self._views_for(p)
        local = local_view(p).detach()
        fields = {"exp_avg": views.exp_avg, "exp_avg_sq": views.exp_avg_sq}
        if views.master is not None:
            fields["master"] = views.master
        for name, view in fields.items():
            source = saved.get(name)
            if source is not None:
                source = local_view(source)
                if source.numel() != local.numel():
                    raise OptimizerError(f"saved {name} has {source.numel()} elements, the parameter's range "
                                         f"{local.numel()}: the checkpoint was saved with another layout")
                view.copy_(source.reshape(view.shape))
            elif name == "master":
                view.copy_(local)
            else:
                view.zero_()
        state.clear()
        state.update(step=int(saved.get("step", 0)), **fields)

    # ---- the update -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, scale: float = 1.0) -> Any:
        """One Adam update of every parameter with a gradient; gradients arrive multiplied by ``scale``."""
        loss, _, items, hypers, keys = self._begin_step(closure)
        runs = self._plans.plan(items, keys)
        self._apply([(run.views(items), hypers[run.members[0]]) for run in runs], scale)
        self.last_step_runs = len(runs)
        return loss

    def _begin_step(self, closure: Callable[[], Any] | None) -> tuple[Any, list[torch.Tensor],
                                                                       list[tuple[torch.Tensor, ...]],
                                                                       list[AdamHyper | None], list[int | None]]:
        """The closure's loss, then every parameter, its step item, its advanced hyperparameters (None
        without a gradient) and its hyperparameter class."""
        check_no_grad_scaler(self)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params: list[torch.Tensor] = []
        items: list[tuple[torch.Tensor, ...]] = []
        hypers: list[AdamHyper | None] = []
        for group in self.param_groups:
            for p in group["params"]:
                params.append(p)
                items.append(self._item(p))
                hypers.append(None if p.grad is None else self._advance(p, group))
        # Plan on which items share hyperparameters, not on their values: a scheduler changes lr (and
        # the step count grows) every step, and the layout must not be replanned for that.
        classes: dict[AdamHyper, int] = {}
        keys = [None if h is None else classes.setdefault(h, len(classes)) for h in hypers]
        return loss, params, items, hypers, keys

    def _item(self, p: torch.Tensor) -> tuple[torch.Tensor, ...]:
        local = local_view(p).detach()
        if p.grad is None:
            return (local,)
        grad = self._dense_grad(p)
        state = self.state[p]
        if not state:
            self._init_state(p, state)
        master = (state["master"],) if "master" in state else ()
        return (local, grad, state["exp_avg"], state["exp_avg_sq"]) + master

    def _dense_grad(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s gradient over its local range; sparse gradients are refused."""
        if p.grad.is_sparse:
            raise OptimizerError(f"{type(self).__name__} needs dense gradients; got a sparse one (e.g. from "
                                 "nn.Embedding(sparse=True)): build that layer with sparse=False")
        return local_view(p.grad)

    def _advance(self, p: torch.Tensor, group: dict[str, Any]) -> AdamHyper:
        state = self.state[p]
        state["step"] += 1
        lr = 0.0 if state["step"] <= self.hold_steps else float(group["lr"])
        beta1, beta2 = group["betas"]
        return AdamHyper(lr, float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
                         state["step"])

    def _apply(self, work: list[tuple[tuple[torch.Tensor, ...], AdamHyper]], scale: float) -> None:
        in_place: dict[tuple, list[tuple[torch.Tensor, ...]]] = {}
        with_master: dict[tuple, list[tuple[torch.Tensor, ...]]] = {}
        write_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        through_device: list[tuple[tuple[torch.Tensor, ...], AdamHyper, torch.device]] = []
        for views, hyper in work:
            param, grad, exp_avg, exp_avg_sq, *master = views
            if not param.is_contiguous():  # a lone strided parameter: the fused kernels want dense memory
                write_back.append((param, param.contiguous()))
                param = write_back[-1][1]
            grad = grad.contiguous()
            device = compute_device(param)
            if device is not None:  # offload="host" on CUDA: the in-memory job's kernel, a chunk at a time
                through_device.append(((param, grad, exp_avg, exp_avg_sq, *master), hyper, device))
            elif param.is_cuda and not self._offload and param.dtype in KERNEL_DTYPES and cupy_usable(param):
                cupy_step(param, grad, master[0] if master else None, exp_avg, exp_avg_sq, hyper, scale)
            elif master:
                with_master.setdefault((hyper, exp_avg.device), []).append((param, grad, master[0], exp_avg, exp_avg_sq))
            else:
                in_place.setdefault((hyper, param.device, param.dtype), []).append((param, grad, exp_avg, exp_avg_sq))
        for (hyper, *_), batch in in_place.items():
            if any(is_offloaded(item[0]) for item in batch):
                # Offloaded shards (offload="disk"): one run at a time, each out of memory again once
                # updated. The fused update is elementwise per tensor, so the results are the same bits.
                for param, grad, exp_avg, exp_avg_sq in batch:
                    torch_adam.step_in_place([param], [grad], [exp_avg], [exp_avg_sq], hyper, scale)
                    release_pages(param, grad)
            else:
                torch_adam.step_in_place(*(list(t) for t in zip(*batch, strict=True)), hyper, scale)
        for (hyper, device), batch in with_master.items():
            torch_adam.step_with_master(batch, hyper, scale, self._scratch_on(device, batch))
            release_pages(*(t for item in batch for t in item[:2]))
        for item, hyper, device in through_device:
            step_through_device([item], device, scale, lambda t, hyper=hyper: self._update_on_device(t, hyper, scale))
        for param, dense in write_back:
            param.copy_(dense)

    def _update_on_device(self, views: list[torch.Tensor], hyper: AdamHyper, scale: float) -> None:
        """One chunk of a host-offloaded run, on the device: what ``_apply`` runs there for in-memory shards."""
        param, grad, exp_avg, exp_avg_sq, *master = views
        if param.dtype in KERNEL_DTYPES and cupy_usable(param):
            cupy_step(param, grad, master[0] if master else None, exp_avg, exp_avg_sq, hyper, scale)
        elif master:
            batch = [(param, grad, master[0], exp_avg, exp_avg_sq)]
            torch_adam.step_with_master(batch, hyper, scale, self._scratch_on(param.device, batch))
        else:
            torch_adam.step_in_place([param], [grad], [exp_avg], [exp_avg_sq], hyper, scale)

    def _scratch_on(self, device: torch.device, batch: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        need = min(torch_adam.SCRATCH_ELEMS, sum(item[0].numel() for item in batch))
        scratch = self._scratch.get(device)
        if scratch is None or scratch.numel() < need:
            pin = self._offload and torch.cuda.is_available()
            scratch = self._scratch[device] = torch.empty(need, dtype=torch.float32, device=device, pin_memory=pin)
        return scratch[:need]

    # ---- checkpoints ----------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` (ours, or torch's Adam/AdamW one: a missing master is taken from the parameter).

        State of a sharded parameter may be this rank's slice, a ``LocalShard`` of it, or the full tensor."""
        state_dict = local_state_dict(self, state_dict)
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups, strict=True)):
            raise OptimizerError(
                f"optimizer state has {[len(s['params']) for s in saved_groups]} parameters per group, this "
                f"optimizer {[len(g['params']) for g in self.param_groups]}: build the optimizer with the same "
                "param groups, in the same order, as the one that was saved")
        by_id = dict(zip(chain.from_iterable(s["params"] for s in saved_groups),
                         chain.from_iterable(g["params"] for g in self.param_groups), strict=True))
        loaded = {by_id[pid]: saved for pid, saved in state_dict["state"].items()}
        self.state.clear()
        with torch.no_grad():
            for p, saved in loaded.items():
                self._init_state(p, self.state[p], saved)
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
