"""Every private torch and transformers name bmt_wrap relies on, behind one small function each.

A torch or transformers upgrade that renames one of these breaks this file only, and
``tests/test_compat.py`` checks each shim against the installed versions (and that no other module
reaches a private name directly). Leaf module: it imports nothing from bmt_wrap.
"""

from __future__ import annotations

import gc
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FunctionType
from typing import Any

import torch
import torch.utils._pytree as pytree  # re-exported: tree_flatten, tree_unflatten, tree_map, register_dataclass
from torch import nn

__all__ = [
    "called_from", "dcp_state_dict_request", "inside_ddp_constructor", "default_store", "disabled_torch_function", "foreach_copy_",
    "foreach_div_", "foreach_mul_", "foreach_norm", "make_wrapper_subclass", "fused_adamw_", "grad_scaler_step_codes", "hf_initialize_weights",
    "hf_initialize_weights_replaced", "make_tensor_subclass", "muon_adjusted_lr", "muon_orthogonalize", "pytree", "register_foreach_type", "queue_autograd_callback", "register_state_dict_hooks", "release_group_defaults", "release_mesh_groups", "reorder_kwargs", "set_version_counters",
    "tensor_version", "watch_writes", "is_compiled_callable",
    # torch.compile
    "compile_context", "compiled_inner", "drop_compiled_call",
]


# ---- autograd ---------------------------------------------------------------------------------------------
def tensor_version(t: torch.Tensor) -> int:
    """The in-place version counter autograd checks (bumped by every in-place op on ``t`` or a view)."""
    return t._version


def set_version_counters(tensors: Sequence[torch.Tensor], versions: Sequence[int]) -> None:
    """Set version counters back (a refill with the same values must not fail saved tensors' checks)."""
    torch._C._autograd._unsafe_set_version_counter(tuple(tensors), tuple(versions))


def queue_autograd_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the current backward pass has finished (from inside a backward hook or node)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


#: A tensor subclass's ``__torch_function__`` that makes ops see a plain tensor (what ``nn.Parameter`` uses).
disabled_torch_function = torch._C._disabled_torch_function_impl


def make_wrapper_subclass(cls: type, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                          requires_grad: bool) -> Any:
    """A storage-less tensor of ``cls`` with this metadata, whose ops reach ``cls.__torch_dispatch__`` (as
    DTensor is built)."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)


# aten's view without the aliasing checks (reshape dispatches to it): a view op a sharded tensor answers.
UNSAFE_VIEW_OP = torch.ops.aten._unsafe_view.default


def foreach_norm(tensors: list[torch.Tensor], ord: float, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """The norm of each tensor (one multi-tensor kernel; what ``clip_grad_norm_`` calls)."""
    return list(torch._foreach_norm(tensors, ord, dtype=dtype))


def muon_orthogonalize(update: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                       eps: float) -> torch.Tensor:
    """torch's Muon Newton-Schulz step on one full matrix (bf16 out), so a sharded Muon matches it bit for bit."""
    from torch.optim._muon import _zeropower_via_newtonschulz
    return _zeropower_via_newtonschulz(update, ns_coefficients, ns_steps, eps)


def muon_adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch's Muon learning-rate adjustment for a matrix of ``shape``."""
    from torch.optim._muon import _adjust_lr
    return _adjust_lr(lr, adjust_lr_fn, shape)


def forget_export_trace() -> None:
    """Drop the nodes torch.export keeps of its last trace: a module-level map (for its fake-tensor leak
    report) holds every node of the graph, with its fake tensors, until the next trace, so a capture's
    graph would otherwise live as long as the process."""
    from torch.fx.experimental import proxy_tensor

    getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", {}).clear()


@contextmanager
def no_stack_traces() -> Iterator[None]:
    """Trace without recording each node's Python stack (torch.fx's ``do_not_emit_stack_traces``)."""
    # Extracting and symbolizing a traceback per node was a quarter of a capture's CPU time; no pass reads
    # ``node.meta["stack_trace"]``.
    from torch.fx import config

    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a FakeTensor (torch.export's and torch.compile's tracing values)."""
    from torch._subclasses.fake_tensor import is_fake as fake

    return bool(fake(t))


def stage_backward_input(stage_outputs: Any, output_grads: Any, input_values: Any, weights: Iterator[Any]) -> Any:
    """torch.distributed.pipelining's inputs-only backward (a zero-bubble schedule's B), as its stage runs it."""
    from torch.distributed.pipelining._backward import stage_backward_input as backward_input

    return backward_input(stage_outputs, output_grads, input_values, weights)


@contextmanager
def masks_as_eager() -> Iterator[None]:
    """transformers' mask builders deciding as in an eager call. Exporting, they always build the [B, 1, S, S]
    causal mask (an exported graph must not bake in ``is_causal``); an eager call without padding (nor a
    window) leaves it to SDPA's ``is_causal`` and, for grouped-query attention, does not repeat K/V. The
    profile counts what a training step holds, so it must see the eager choice: a 2-rank Llama of width 512
    was counted 16 MiB a rank too many at 4096 tokens, quadratic in the sequence. A padding mask passed in
    is a traced tensor whose values are unknown, so the mask is built for it, as eager builds it for padding."""
    masking = sys.modules.get("transformers.masking_utils")
    exporting = getattr(masking, "is_torchdynamo_exporting", None)
    if exporting is None:
        yield
        return
    masking.is_torchdynamo_exporting = lambda: False  # type: ignore[union-attr]
    try:
        yield
    finally:
        masking.is_torchdynamo_exporting = exporting  # type: ignore[union-attr]


def register_foreach_type(cls: type) -> None:
    """Let torch's optimizers and ``clip_grad_norm_`` take their multi-tensor paths for tensors of ``cls``
    (the lists they check by exact type; DTensor registers itself the same way)."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    for types in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if cls not in types:
            types.append(cls)


def make_tensor_subclass(cls: type, data: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """``data`` as an instance of the tensor subclass ``cls``, sharing its storage (what Parameter does)."""
    return torch.Tensor._make_subclass(cls, data, requires_grad)


# Ops that write an argument their schema does not mark as written: batch norm's running statistics
# (argument indices 3 and 4, when argument 5, ``training``, is true).
_UNMARKED_WRITES = {"native_batch_norm": (3, 4), "cudnn_batch_norm": (3, 4), "miopen_batch_norm": (3, 4)}


def _written(func: Any, args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    schema = func._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):  # the _foreach_ ops' Tensor(a!)[]
            yield from (v for v in value if isinstance(v, torch.Tensor))
    unmarked = _UNMARKED_WRITES.get(schema.name.partition("::")[2])
    if unmarked and len(args) > 5 and args[5]:
        yield from (args[i] for i in unmarked if isinstance(args[i], torch.Tensor))


def is_compiled_callable(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is what ``torch.compile(f)`` returned (dynamo keeps the original on it)."""
    return hasattr(fn, "_torchdynamo_orig_callable")


@contextmanager
def watch_writes(before_write: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call ``before_write(t)`` before each op (below autograd, every dispatched aten op) writes ``t``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            for t in _written(func, args, kwargs):
                before_write(t)
            return func(*args, **kwargs)

    with _Watch():
        yield


# ---- kernels ----------------------------------------------------------------------------------------------
def foreach_mul_(tensors: list[torch.Tensor], scalar: float | torch.Tensor) -> None:
    """Multiply every tensor in place by ``scalar`` (one multi-tensor kernel)."""
    torch._foreach_mul_(tensors, scalar)


def foreach_div_(tensors: list[torch.Tensor], scalar: float | torch.Tensor) -> None:
    """Divide every tensor in place by ``scalar`` (one multi-tensor kernel)."""
    torch._foreach_div_(tensors, scalar)


def foreach_copy_(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for every pair (one multi-tensor kernel)."""
    torch._foreach_copy_(dsts, srcs)


def fused_adamw_(*args: Any, **kwargs: Any) -> None:
    """torch's fused AdamW step over lists of params, grads and moments (``torch.optim.AdamW(fused=True)``'s)."""
    torch._fused_adamw_(*args, **kwargs)


# ---- modules, export, distributed --------------------------------------------------------------------------
def register_state_dict_hooks(module: nn.Module, save: Callable[..., Any], load_pre: Callable[..., Any]) -> None:
    """Hooks that rewrite ``module``'s state_dict on save and the incoming one before load."""
    module._register_state_dict_hook(save)
    module._register_load_state_dict_pre_hook(load_pre, with_module=True)


def reorder_kwargs(kwargs: dict[str, Any], spec: Any) -> tuple[Any, ...]:
    """``kwargs`` in the order an exported program's input spec expects."""
    from torch.export._tree_utils import reorder_kwargs as _reorder

    return _reorder(kwargs, spec)


def default_store() -> Any:
    """The default process group's key-value store (for exchanging a NCCL unique id)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def release_group_defaults(group: Any) -> list[str]:
    """Set to None each default argument of a torch function that holds ``group``; return the names of the
    functions outside torch whose defaults hold it (left as they are).

    torch.distributed.nn.functional, ZeroRedundancyOptimizer and ShardedGradScaler write
    ``group=dist.group.WORLD`` in signatures: a module loaded while a default group exists holds that group
    for the rest of the process, past ``destroy_process_group``. None is the value those parameters get when
    loaded before any group, and means "the default group" at each call.
    """
    others = []
    for fn in gc.get_objects():  # functions are always tracked; the tuples holding a group often are not
        if type(fn) is not FunctionType:  # isinstance would ask deprecated proxies for __class__
            continue
        defaults, kwdefaults = fn.__defaults__ or (), fn.__kwdefaults__ or {}
        if not any(d is group for d in (*defaults, *kwdefaults.values())):
            continue
        if (fn.__module__ or "").partition(".")[0] != "torch":
            others.append(f"{fn.__module__}.{fn.__qualname__}")
            continue
        if defaults:
            fn.__defaults__ = tuple(None if d is group else d for d in defaults)
        if kwdefaults:
            fn.__kwdefaults__ = {k: None if v is group else v for k, v in kwdefaults.items()}
    return others


def release_mesh_groups() -> int:
    """Empty the process-group registry of every live ``DeviceMesh``; return how many meshes held groups.

    A DeviceMesh keeps its groups in ``_pg_registry`` for as long as it lives, and an HSDP script keeps its
    mesh to the end: the destroyed groups, and gloo's threads, would then live into interpreter teardown.
    Call only once every group is destroyed (the mesh is unusable from then on anyway).
    """
    emptied = 0
    for obj in gc.get_objects():
        if type(obj).__name__ != "DeviceMesh" or not type(obj).__module__.startswith("torch.distributed"):
            continue
        registry = getattr(obj, "_pg_registry", None)
        if isinstance(registry, dict) and registry:
            registry.clear()
            emptied += 1
    return emptied


# ---- Python frames and GradScaler ------------------------------------------------------------------------
def called_from(codes: set[Any], max_depth: int) -> bool:
    """Whether any of the frames above the caller (up to ``max_depth``) runs one of ``codes``."""
    frame = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None:
            return False
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def inside_ddp_constructor(max_depth: int = 64) -> bool:
    """Whether the caller runs inside ``DistributedDataParallel.__init__`` (its parameter broadcast)."""
    ddp = sys.modules.get("torch.nn.parallel.distributed")
    return ddp is not None and called_from({ddp.DistributedDataParallel.__init__.__code__}, max_depth)


def dcp_state_dict_request(max_depth: int = 16) -> Any | None:
    """The options of the ``torch.distributed.checkpoint.state_dict`` call (``get_state_dict`` and friends)
    that the caller runs inside of, or None: read from that call's frame (its ``info``: ``full_state_dict``,
    ``cpu_offload``), because DCP gives a module no other way to know it is being checkpointed."""
    dsd = sys.modules.get("torch.distributed.checkpoint.state_dict")
    if dsd is None:  # not loaded: nothing of it can be running
        return None
    codes = {inspect.unwrap(fn).__code__ for fn in (dsd._get_model_state_dict, dsd._get_optim_state_dict)}
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        if frame.f_code in codes:
            return frame.f_locals.get("info")
        frame = frame.f_back
    return None


def grad_scaler_step_codes() -> frozenset[Any]:
    """Code objects through which ``GradScaler`` calls ``optimizer.step()`` (subclasses inherit them)."""
    from torch.amp import GradScaler

    return frozenset({GradScaler.step.__code__, GradScaler._maybe_opt_step.__code__})


# ---- torch.compile ----------------------------------------------------------------------------------------
def _dynamo_eval_frame() -> Any:
    """torch's dynamo front end if something loaded it, else None: nothing was compiled before it loads, and
    importing it takes over a second, so code that never compiles never pays for it."""
    return sys.modules.get("torch._dynamo.eval_frame")


def compiled_inner(module: nn.Module) -> nn.Module | None:
    """The module that ``torch.compile(m)`` wrapped, when ``module`` is that wrapper (an ``OptimizedModule``,
    whose parameters plain torch names ``_orig_mod.*``); None for any other module."""
    eval_frame = _dynamo_eval_frame()
    if eval_frame is None or not isinstance(module, eval_frame.OptimizedModule):
        return None
    return module._orig_mod


def compile_context(module: nn.Module) -> Callable[[Callable[..., Any]], Callable[..., Any]] | None:
    """How ``module`` was compiled, by ``torch.compile(m)`` or ``m.compile(...)``: a function that compiles
    another callable with the same options. None when ``module`` is not compiled.

    Raises ``LookupError`` when ``module`` is compiled but this torch keeps the options where this shim does
    not look (the closure of ``m.compile()``'s compiled ``_call_impl``).
    """
    if compiled_inner(module) is not None:
        return module.dynamo_ctx
    call = module.__dict__.get("_compiled_call_impl")
    if call is None:
        return None
    eval_frame = _dynamo_eval_frame()
    for cell in getattr(call, "__closure__", None) or ():
        if eval_frame is not None and isinstance(cell.cell_contents, eval_frame._TorchDynamoContext):
            return cell.cell_contents
    raise LookupError(f"{type(module).__name__}.compile() left no compile context where torch 2.13 keeps it")


def drop_compiled_call(module: nn.Module) -> None:
    """Call ``module`` eagerly again: drop ``m.compile()``'s compiled ``__call__``; a ``torch.compile(m)``
    wrapper calls its inner module directly (its ``forward`` was the compiled call)."""
    inner = compiled_inner(module)
    if inner is not None:
        module.forward = inner.__call__  # an attribute OptimizedModule keeps on itself, not on _orig_mod
    else:
        module.__dict__.pop("_compiled_call_impl", None)


# ---- transformers -----------------------------------------------------------------------------------------
def hf_initialize_weights(model: nn.Module) -> Callable[..., Any]:
    """The per-module initializer ``PreTrainedModel.initialize_weights()`` applies (``_initialize_weights``)."""
    return model._initialize_weights


@contextmanager
def hf_initialize_weights_replaced(replacements: dict[nn.Module, Callable[..., Any]]) -> Iterator[None]:
    """Each model's ``_initialize_weights`` replaced (on the instance: transformers looks it up per model)."""
    for model, fn in replacements.items():
        model.__dict__["_initialize_weights"] = fn
    try:
        yield
    finally:
        for model in replacements:
            model.__dict__.pop("_initialize_weights", None)
