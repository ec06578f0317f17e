"""bmt-wrap: show how bmt_wrap would shard a model, without running it or allocating its weights.

    bmt-wrap dump MODULE:FACTORY [--world-size N] [--format text|json|dot] [--input SPEC ...] [-v]
    bmt-wrap plan MODULE:FACTORY --world-size N [N ...] [--dtype bf16 | --mixed-precision bf16]
                  [--memory-budget 40GiB] [--shard-size S | --tp-size T [--sequence-parallel]] [--input SPEC ...] [-v]
    bmt-wrap plan MODULE:FACTORY --world-size N --memory 8GiB --input SPEC ... [--grow n_layers] [--streaming] [--json]
                  [--optimizer-state memory|disk [--optimizer-chunk 32MiB]] [--offload disk] [--tp-size T] [--ep-size E]
    bmt-wrap plan MODULE:FACTORY --world-size N [N ...] --offload host [--input SPEC ...]
    bmt-wrap plan MODULE:FACTORY --world-size N [N ...] --pp-size P [--virtual-stages V] [--microbatches M] [--tp-size T]
                  [--input SPEC ...]
    bmt-wrap plan MODULE:FACTORY --world-size N --pp-size P [--virtual-stages V] [--microbatches M] --memory 8GiB
                  --input SPEC ... [--grow KW]
    bmt-wrap plan MODULE:FACTORY --world-size N [N ...] --ep-size E [--tp-size T] [--input SPEC ...]
    bmt-wrap plan MODULE:FACTORY --world-size N [N ...] --cp-size C [--cp-method auto|ulysses|ring] --input SPEC ...
    bmt-wrap plan MODULE:FACTORY --world-size N --cp-size C --memory 8GiB --input SPEC ... [--grow-seq STEP]

MODULE is a dotted module name (importable from the current directory) or a path to a ``.py`` file;
FACTORY is called with no arguments under ``with torch.device("meta")``. An input SPEC such as
``input_ids=int64[1,128]`` (or ``float32[2,3,224,224]`` for a positional input) gives the shapes
``torch.export`` and the activation estimate need. ``--dtype`` estimates BMTrain's design (the model cast
before wrapping: low-precision shards, the optimizer's fp32 masters); ``--mixed-precision`` estimates
``mixed_precision=bmt.MixedPrecision(param_dtype=...)`` (fp32 shards, gathers and compute in that dtype).
``--shard-size S`` adds, per world size, HSDP with shards over S ranks (one node) beside ZeRO-3 over
every rank, each with its traffic split into intra-node and inter-node bytes for nodes of S ranks.
``--pp-size P [--microbatches M]`` plans ``BMTrainModelWrapper(model, pp_size=P, pp_microbatches=M)``: the
stage split, each stage's bytes per rank (shards, its blocks held gathered for the step, activations and the
received activations GPipe holds, 1F1B's bound beside), the bubble (P-1)/(M+P-1) and the point-to-point
and ZeRO bytes per rank per step (with --input for the activations); with ``--tp-size T`` the stages' blocks
are split over T ranks (bytes per TP rank); ``dump --pp-size P`` shows the stages; with ``--memory`` the answer
is the peak of the stage whose ranks peak highest under the GPipe loop. ``--virtual-stages V`` plans
``pp_virtual_stages=V``: P x V stages, rank r running r, r+P, ...; each rank's sums over its stages under the
GPipe loop and Interleaved1F1B, and the interleaved bubble (P-1)/(V M+P-1); ``--memory`` answers for the rank.
``--tp-size T`` plans ``BMTrainModelWrapper(model, tp_size=T)``: the TP section (split modules, head counts,
what stays replicated and why), ZeRO over N/T data-parallel ranks, and the TP traffic for --input's tokens;
with ``--sequence-parallel``, ``sequence_parallel=True``'s section and traffic.
``--ep-size E`` adds expert parallelism's view of the mixture-of-experts layers (found by structure, each
one's experts placed over E ranks, what stays dense and why) and, per world size, each rank's expert bytes,
the all-to-all bytes per step for --input's tokens (uniform routing) and the owners' ZeRO bytes, beside
ZeRO-3's gather and reduce-scatter bytes for the same experts; the per-rank table counts each rank's experts
over the ranks owning them. With ``--tp-size T`` the attention is split by TP and the experts by EP over E of
the N/T data-parallel ranks, whose owners' TP peers share their shards (each rank holds 1/N of the experts).
``--cp-size C [--cp-method M]`` plans ``BMTrainModelWrapper(model, cp_size=C, cp_method=M)`` for a
transformers model: --input is one rank's whole batch (CP peers take the same one), each rank's activations
are counted on its ``seq / C`` tokens, and the CP section gives the method "auto" picks, the attentions'
heads, and the bytes each rank sends per step for them (all-to-all or ring; forward, backward, recompute).
``--grow-seq STEP`` (with ``--memory``) answers the longest sequence, a multiple of STEP tokens, whose
training step fits: --input's tensors whose dim 1 is the sequence grow together (with --cp-size, STEP must
be a multiple of 2 x C, the load-balanced split's chunks).
``--memory B`` (bytes summed over the job's ranks) answers whether a training process fits: its peak per
rank is the process baseline (this process's resident memory before building anything, or ``--baseline``)
plus the larger of wrapping's peak (the full copy built before wrapping and the shards made while its
originals go; none with ``--streaming``, the model built on the meta device and loaded) and training's
(the largest of its phases, with the activations of ``--input``'s batch, which it needs), and a margin of
that count for its known error. With ``--grow KW`` the factory takes ``KW=k`` and the answer is the largest
``k`` that fits. With ``--tp-size T`` (and ``--ep-size E``) it answers for that layout: ZeRO-3 over the N / T
data-parallel ranks with the split parameters' local shapes, activations unsplit (an upper bound), the model
built whole before TP and EP cut it.
``--optimizer-state disk`` answers for ``bmt.optim.AdamDiskOptimizer``: the Adam moments and fp32 masters
leave memory for a file, a ``--optimizer-chunk`` staging buffer stays, and the answer adds the bytes each
rank reads and writes per step. ``--offload disk`` plans ``BMTrainModelWrapper(model, offload="disk")``: the
parameter and gradient shards leave memory for a file per rank except those in flight, and the estimates
add the bytes each rank reads from and writes to it per step (with or without ``--memory``). ``--offload
host`` plans ``offload="host"`` for a CUDA job: the estimates count the device, which holds the shards in
flight and one chunk of ``AdamOptimizer``'s state, and add the bytes each rank copies between host and
device per step (``--memory`` answers for a CPU process, so it does not take it).
An input the forward does not take, or a memory budget no schedule meets, is an error.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import traceback
import typing
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from . import process_baseline
from .base._compat import pytree
from .base.dtypes import to_dtype
from .base.expert_plan import ExpertPlan, experts_text
from .base.host_allocator import EXACT_SETTING
from .base.mixed_precision import MixedPrecision
from .base.pipeline_plan import pipeline_text
from .base.plan import (
    WrapPlan,
    cp_text,
    fmt_bytes,
    fused_loss_text,
    layout_label,
    render_estimates,
    shown_notes,
    summary_line,
)
from .base.tp_plan import TensorParallelPlan
from .errors import BMTError, CLIError, MemoryBudgetError, PipelineError, PlanError
from .passes.capacity import (
    MARGIN,
    MARGIN_REASON,
    ProcessPeak,
    largest_fitting,
    optimizer_on_disk,
    pipeline_peak,
    process_peak,
    training_phases,
    with_peak,
)
from .passes.capture import Call, Capture, capture, token_count
from .passes.context_parallel import local_call, plan_context_parallel, with_sequence
from .passes.discover import discover_blocks
from .passes.estimate import estimate_mesh, estimate_tp
from .passes.experts import check_tp_split, plan_experts
from .passes.fused_loss import fuse_loss, fused_loss_section, with_fused_loss
from .passes.pipeline import estimate_pipeline, pipeline_report, plan_pipeline, rank_estimates
from .passes.planner import build_plan
from .passes.render import render_dot, render_json, render_text
from .passes.schedule_graph import schedule_graph
from .passes.sequence_parallel import chain_from_capture, plan_sequence_parallel
from .passes.tensor_parallel import plan_tensor_parallel
from .passes.util import describe
from .process_baseline import ProcessBaseline

#: ``AdamDiskOptimizer``'s default ``chunk_bytes`` (optim/adam_disk.py; a test checks they agree): the CLI
#: does not import the optimizers, whose import would count in the process baseline it measures.
DISK_CHUNK_DEFAULT = "32MiB"

_SPEC = re.compile(r"^(?:(?P<name>[A-Za-z_]\w*)=)?(?P<dtype>\w+)\[(?P<shape>\d+(?:\s*,\s*\d+)*)?\]$")
_BYTES = re.compile(r"^(?P<value>\d+(?:\.\d+)?)\s*(?P<unit>[KMGT]i?B|B)?$", re.IGNORECASE)
_UNIT = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_input(spec: str) -> tuple[str | None, torch.Tensor]:
    """``name=dtype[d0,d1,...]`` (or ``dtype[...]`` for a positional input) -> (name, meta tensor)."""
    match = _SPEC.match(spec.strip())
    if match is None:
        raise CLIError(f"bad --input {spec!r}: expected NAME=DTYPE[D0,D1,...], e.g. 'input_ids=int64[1,128]'")
    try:
        dtype = to_dtype(match["dtype"])
    except BMTError as exc:
        raise CLIError(f"bad --input {spec!r}: {exc}") from None
    shape = [int(d) for d in match["shape"].split(",")] if match["shape"] else []
    return match["name"], torch.empty(shape, dtype=dtype, device="meta")


def parse_inputs(specs: list[str]) -> Call | None:
    """Every ``--input`` as one call: unnamed specs are positional, in order; named ones keyword."""
    if not specs:
        return None
    args: list[torch.Tensor] = []
    kwargs: dict[str, torch.Tensor] = {}
    for spec in specs:
        name, tensor = parse_input(spec)
        if name is None:
            args.append(tensor)
        elif name in kwargs:
            raise CLIError(f"--input {name!r} is given twice")
        else:
            kwargs[name] = tensor
    return tuple(args), kwargs


# PEP 692: ``**kwargs: Unpack[TD]`` takes only TD's keys (transformers' forwards); typing has Unpack from 3.11.
_UNPACK = getattr(typing, "Unpack", None)


def check_inputs(model: nn.Module, call: Call) -> None:
    """Raise ``CLIError``, showing the forward's signature, unless ``model.forward`` takes these inputs."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):  # no signature to check against: the capture reports what fails
        return
    args, kwargs = call
    # Unknown names first: bind() would report a missing argument instead, hiding the misspelt one.
    reason = _unknown_names(sig, kwargs)
    if reason is None:
        try:
            sig.bind(*args, **kwargs)
        except TypeError as exc:
            reason = str(exc)
    if reason is not None:
        shown = sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                            return_annotation=sig.empty)
        raise CLIError(f"--input does not fit {type(model).__name__}.forward{shown}: {reason}; name each --input "
                       "after an argument there (unnamed ones fill the positional arguments in order)")


def _unknown_names(sig: inspect.Signature, kwargs: dict[str, object]) -> str | None:
    named = {n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    var = next((p for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    only = ""
    if var is not None:
        unpacked = _UNPACK is not None and typing.get_origin(var.annotation) is _UNPACK
        typed = typing.get_args(var.annotation)[0] if unpacked else None
        if not typing.is_typeddict(typed):
            return None  # a plain **kwargs takes any name
        named |= typed.__required_keys__ | typed.__optional_keys__
        only = f" (its **{var.name} take only {typed.__name__}' keys)"
    unknown = [k for k in kwargs if k not in named]
    return f"it has no argument {', '.join(map(repr, unknown))}{only}" if unknown else None


def budget_error(budget: int, over: list[MemoryBudgetError], prefetch_depth: int) -> CLIError:
    """One error for every world size whose plan cannot meet ``budget``, naming the smallest budget each needs."""
    needs = ", ".join(f"N={e.world_size} needs at least {fmt_bytes(e.needed)} ({e.needed} B)" for e in over)
    unknown = ", plus activations (unknown without --input)" if any(not e.activations_known for e in over) else ""
    return CLIError(f"--memory-budget {fmt_bytes(budget)} per rank cannot be met even with every block checkpointed "
                    f"(prefetch depth {prefetch_depth}): {needs}{unknown}; raise the budget, add ranks, "
                    "shrink the batch or lower --prefetch-depth")


def parse_bytes(text: str, option: str = "--memory-budget") -> int:
    """``40GiB``, ``512MiB``, ``1.5GB`` or a plain number of bytes."""
    match = _BYTES.match(text.strip())
    if match is None:
        raise CLIError(f"bad {option} {text!r}: expected a size such as 40GiB, 512MiB or 80GB")
    return int(float(match["value"]) * _UNIT[(match["unit"] or "").lower()])


def _on_path(folder: Path) -> None:
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


def load_factory(target: str) -> Callable[[], object]:
    """Resolve ``MODULE:FACTORY`` (a dotted module or a ``.py`` path) to the factory callable."""
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise CLIError(f"bad model {target!r}: expected MODULE:FACTORY, e.g. 'mypkg.models:build' or "
                       "'tests/models.py:llama_7b'")
    try:
        if module_name.endswith(".py") or "/" in module_name:
            path = Path(module_name)
            if not path.is_file():
                raise CLIError(f"no such file {module_name!r}")
            spec = importlib.util.spec_from_file_location(f"bmt_wrap_cli_target.{path.stem}", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses and pickling look classes up by module name
            _on_path(path.resolve().parent)  # so the file's own sibling imports work
            spec.loader.exec_module(module)
        else:
            _on_path(Path.cwd())  # console scripts do not put the current directory on sys.path
            module = importlib.import_module(module_name)
    except CLIError:
        raise
    except Exception as exc:
        raise CLIError(f"cannot import {module_name!r}: {describe(exc)}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CLIError(f"{module_name!r} has no callable {attr!r}")
    return factory


def build_model(target: str, **kwargs: object) -> nn.Module:
    """Call the factory (with ``kwargs``) under the meta device: no weight is allocated."""
    factory = load_factory(target)
    try:
        with torch.device("meta"):
            model = factory(**kwargs)
    except Exception as exc:
        raise CLIError(f"factory {target!r} raised {describe(exc)}") from exc
    if not isinstance(model, nn.Module):
        raise CLIError(f"factory {target!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def build_parser() -> argparse.ArgumentParser:
    """The ``bmt-wrap`` argument parser: the ``dump`` and ``plan`` subcommands and their options."""
    parser = argparse.ArgumentParser(prog="bmt-wrap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("model", help="MODULE:FACTORY, e.g. tests/models.py:llama_7b")
    common.add_argument("--input", action="append", default=[], metavar="SPEC",
                        help="one rank's example input, NAME=DTYPE[SHAPE] or DTYPE[SHAPE]; repeatable; needed for "
                             "activations")
    common.add_argument("--dtype", default=None, help="parameter dtype (bf16, fp16, fp32); default: the model's")
    common.add_argument("--mixed-precision", default=None, metavar="DTYPE",
                        help="MixedPrecision(param_dtype=DTYPE): fp32 shards, DTYPE gathers and compute, fp32 "
                             "gradient reduction")
    common.add_argument("--memory-budget", default=None, metavar="SIZE",
                        help="bytes per rank, e.g. 40GiB: keep parameters gathered, then activations, per block "
                             "while they fit (needs --input; an error naming the smallest budget if none fits)")
    common.add_argument("--prefetch-depth", type=int, default=1, metavar="DEPTH",
                        help="blocks gathered ahead (default 1)")
    common.add_argument("--fused-loss", action="store_true",
                        help="fuse the projection to the vocabulary with its cross-entropy (fused_loss=True); "
                             "without it the plan shows the logits' bytes and what fusing would save (give "
                             "--input with labels, e.g. --input input_ids=int64[1,512] --input labels=int64[1,512])")
    common.add_argument("--pp-size", type=int, default=None, metavar="P",
                        help="plan pipeline stages (pp_size=P): the stage split, each stage's bytes per rank, the "
                             "bubble and the point-to-point bytes (dump shows the stages)")
    common.add_argument("--microbatches", type=int, default=None, metavar="M",
                        help="with --pp-size: micro-batches per step (pp_microbatches=M; default P)")
    common.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                        help="with --pp-size: stages per rank (pp_virtual_stages=V; default 1): P x V stages, rank r "
                             "running r, r+P, ...; each rank's bytes and the interleaved bubble")
    common.add_argument("-v", "--verbose", action="store_true",
                        help="also show expected fallbacks (fx failing on a model torch.export then captures)")
    common.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    dump = sub.add_parser("dump", parents=[common], help="print the rewritten graph and the plan")
    dump.add_argument("--world-size", type=int, default=1, metavar="N", help="ranks to plan for (default 1)")
    dump.add_argument("--format", choices=("text", "json", "dot"), default="text",
                      help="text (default): graph and tables; json: the plan, re-appliable with "
                           "WrapPlan.from_json, and the graph; dot: Graphviz")
    plan = sub.add_parser("plan", parents=[common], help="print per-rank memory and communication estimates")
    plan.add_argument("--world-size", type=int, nargs="+", required=True, metavar="N",
                      help="one or more world sizes, a column each")
    plan.add_argument("--shard-size", type=int, default=None, metavar="S",
                      help="also estimate HSDP (mesh= (N/S, S): shards within nodes of S ranks, replicas across "
                           "them) and split each column's traffic into intra- and inter-node bytes")
    plan.add_argument("--tp-size", type=int, default=None, metavar="T",
                      help="plan tensor parallelism over T adjacent ranks (tp_size=T): ZeRO shards over N/T "
                           "ranks; the TP traffic needs --input for its token count")
    plan.add_argument("--ep-size", type=int, default=None, metavar="E",
                      help="plan expert parallelism over E ranks (ep_size=E): the MoE layers, their experts' "
                           "placement, and per rank the expert bytes and all-to-all bytes per step (--input's "
                           "tokens) beside ZeRO-3's bytes for the same experts")
    plan.add_argument("--cp-size", type=int, default=None, metavar="C",
                      help="plan context parallelism over C ranks (cp_size=C): activations on seq/C tokens per "
                           "rank, and the all-to-all or ring bytes per step (needs --input)")
    plan.add_argument("--cp-method", choices=("auto", "ulysses", "ring"), default="auto",
                      help="with --cp-size: cp_method= (default auto: Ulysses with at least C heads, else ring)")
    plan.add_argument("--grow-seq", type=int, default=None, metavar="STEP",
                      help="with --memory: answer the longest sequence (a multiple of STEP tokens) that fits; "
                           "--input's sequence dims grow")
    plan.add_argument("--sequence-parallel", action="store_true",
                      help="with --tp-size: plan sequence_parallel=True (norms and residuals on sequence parts; "
                           "the traffic as all-gathers and reduce-scatters along the sequence)")
    plan.add_argument("--memory", default=None, metavar="SIZE",
                      help="the job's memory summed over its ranks, e.g. 8GiB: the process's peak per rank "
                           "and whether it fits (one --world-size; needs --input, for the activations)")
    plan.add_argument("--grow", default=None, metavar="KW",
                      help="with --memory: the factory's keyword to grow (e.g. n_layers); answers its "
                           "largest value that fits")
    plan.add_argument("--streaming", action="store_true",
                      help="with --memory: the model is built on the meta device and loaded "
                           "(bmt.from_pretrained), so no full copy exists before wrapping")
    plan.add_argument("--baseline", default=None, metavar="SIZE",
                      help="with --memory: a rank's resident memory before building the model (default: "
                           "this process's, measured after it built and traced the smallest model once, so the "
                           "model library and the first forward's trace count as they do on a rank; with "
                           "--grow of layers and --input, after training it one step, and its 2- and 4-layer "
                           "forms too, for the memory beside the tensors each layer adds). Given, nothing is "
                           "trained or measured")
    plan.add_argument("--json", action="store_true", help="with --memory: print the answer as JSON")
    plan.add_argument("--optimizer-state", choices=["memory", "disk"], default=None,
                      help="with --memory: where Adam's state lives; disk: bmt.optim.AdamDiskOptimizer's "
                           "file (default memory)")
    plan.add_argument("--optimizer-chunk", default=None, metavar="SIZE",
                      help=f"with --optimizer-state disk: its staging buffer (chunk_bytes; default "
                           f"{DISK_CHUNK_DEFAULT})")
    plan.add_argument("--offload", choices=["disk", "host"], default=None,
                      help="plan offload='disk' (parameter and gradient shards in a file per rank) or 'host' "
                           "(a CUDA job's in host memory): only those in flight in (device) memory")
    return parser


def warm_baseline(opts: argparse.Namespace, inputs: Call | None) -> ProcessBaseline:
    """A training rank's resident memory beside its tensors: this process's after building the smallest
    model and freeing it. With ``--grow`` and ``--input`` that model (one layer, real weights) is wrapped
    and trained one step first, as a rank does: the kernels a real step pages in, the optimizer's module
    and the heap the runtime's objects grow stay in a rank for good (about 35 MiB on four transformers
    families beyond a trace alone); a ``--grow`` of layers also trains 2 and 4 layers, for the bytes beside
    the tensors each layer adds. Without them it is built on meta and captured: the model library's import
    (about 100 MiB for a Llama) and torch.export's machinery (about 60 MiB) stay too."""
    if inputs is not None and opts.grow and os.environ.get("WORLD_SIZE", "1") == "1":
        factory = load_factory(opts.model)
        return process_baseline.measure(lambda k: factory(**{opts.grow: k}), inputs, opts.optimizer_state,
                                        opts.offload, process_baseline.grows_by_layers(opts.grow))
    model = build_model(opts.model, **({opts.grow: 1} if opts.grow else {}))
    if inputs is not None:
        capture(model, discover_blocks(model), inputs)
    del model
    return ProcessBaseline(process_baseline.settled_resident_bytes())


def _capacity(opts: argparse.Namespace) -> str:
    """``plan --memory``: the process's peak per rank for the model, or the largest ``--grow`` that fits."""
    if len(opts.world_size) != 1:
        raise CLIError("--memory answers for one --world-size at a time")
    n = opts.world_size[0]
    limit = parse_bytes(opts.memory, "--memory")
    inputs = parse_inputs(opts.input)
    if inputs is None:
        # Without them the step's activations count as nothing: a 2-rank Llama of width 256 was answered
        # 86 layers under 2 GiB and peaked 17% over it.
        raise CLIError("--memory answers for a training step, whose activations depend on its input: give one "
                       "rank's batch as the training loop calls the model, e.g. --input input_ids=int64[4,512] "
                       "--input labels=int64[4,512] (NAME=DTYPE[SHAPE] per argument, DTYPE[SHAPE] for a "
                       "positional one)")
    baseline = (ProcessBaseline(parse_bytes(opts.baseline, "--baseline")) if opts.baseline
                else warm_baseline(opts, inputs))
    budget = parse_bytes(opts.memory_budget) if opts.memory_budget else None
    t = opts.tp_size or 1
    if t < 1 or n % t:
        raise CLIError(f"--tp-size {t} must divide --world-size {n} (data-parallel size x TP size)")
    if opts.ep_size is not None and (opts.ep_size < 1 or (n // t) % opts.ep_size):
        each = f"the {n // t} data-parallel ranks of --world-size {n} / --tp-size {t}" if t > 1 else \
            f"--world-size {n}"
        raise CLIError(f"--ep-size {opts.ep_size} must divide {each}")
    if opts.ep_size is not None and opts.pp_size is not None:
        raise CLIError("--memory counts --ep-size or --pp-size, not both (the wrapper refuses ep_size= beside "
                       "pp_size=): drop one")
    tokens = token_count(inputs)
    if opts.ep_size is not None and tokens is None:
        raise CLIError("--memory with --ep-size counts the all-to-all buffers for the tokens a rank routes: give "
                       "the token ids in --input, e.g. --input input_ids=int64[4,512]")

    cp = _check_cp(opts, [n], inputs)
    if opts.grow_seq is not None:
        if opts.grow:
            raise CLIError("--grow grows a factory keyword and --grow-seq the input's sequence: give one")
        if opts.grow_seq < 1 or opts.grow_seq % (2 * cp):
            raise CLIError(f"--grow-seq {opts.grow_seq} must be a positive multiple of 2 x cp size = {2 * cp} "
                           "(the load-balanced split's chunks)")
    on_disk = opts.optimizer_state == "disk"
    if opts.optimizer_chunk and not on_disk:
        raise CLIError("--optimizer-chunk sizes the disk optimizer's buffer: add --optimizer-state disk")
    chunk = parse_bytes(opts.optimizer_chunk or DISK_CHUNK_DEFAULT, "--optimizer-chunk")
    io: dict[int | None, int] = {}
    exchanged: dict[int | None, int] = {}  # under --ep-size: the all-to-all buffers counted (est.exchange)
    shards_io: dict[int | None, tuple[int, int]] = {}

    @functools.cache  # the search's last probe is often the answer, printed in full after it
    def peak(k: int | None) -> tuple[ProcessPeak, str, dict[str, int]]:
        model = build_model(opts.model, **({opts.grow: k} if opts.grow else {}))
        dtype = _dtype_option(opts.dtype, "--dtype")
        model = model.to(dtype) if dtype is not None else model
        discovery = discover_blocks(model)
        call = with_sequence(inputs, k * opts.grow_seq) if opts.grow_seq and k is not None else inputs
        captured = capture(model, discovery, local_call(call, cp) if opts.cp_size else call)
        if opts.pp_size is not None:
            section = fused_loss_section(model, captured, enabled=opts.fused_loss)
            return _stages_peak(model, discovery, opts, n, with_fused_loss(captured, section), budget, baseline, k)
        # TP: split parameters in their local shapes, ZeRO-3 over the n / t data-parallel ranks (estimate_tp).
        # EP: each rank's experts in their local shapes, sharded over their owners, and the exchange's buffers.
        tp = plan_tensor_parallel(model, t, discovery) if t > 1 else None
        experts = _expert_section(model, opts, [n], tp)
        section = fused_loss_section(model, captured, enabled=opts.fused_loss, tensor_parallel=tp)
        plan = build_plan(model, discovery, world_size=n // t, prefetch_depth=opts.prefetch_depth,
                          memory_budget=budget, capture=with_fused_loss(captured, section), offload=opts.offload,
                          tensor_parallel=tp, experts=experts)
        est = plan.estimates[str(n // t)]
        if experts is not None:  # counted by the plan, as memory_budget= counts them (capacity.scheduled_estimate)
            exchanged[k] = est.exchange
        context = ""
        if opts.cp_size:  # one attention's exchange buffers and mask, held beside a block's backward
            cp_section = plan_context_parallel(model, cp, opts.cp_method, call, est.activations,
                                               recomputed=sum(g.checkpoint for g in plan.blocks()))
            est = replace(est, exchange=cp_section.attention_bytes())
            exchanged[k] = est.exchange
            context = "".join(f"\n  {line}" for line in cp_text(cp_section))
        if on_disk:
            est, io[k] = optimizer_on_disk(plan, est, chunk)
        p = process_peak(plan, est, baseline.resident, built_full=not opts.streaming,
                         beside=baseline.per_layer * (k - 1) if k is not None else 0,
                         wrapping_baseline=baseline.before_training, margin_fraction=MARGIN)
        params = sum(g.param_numel() for g in plan.groups)
        tp_line = (f"\n  tensor parallelism over {t} ranks: {params:,} parameters per TP rank, ZeRO-3 over the "
                   f"{n // t} data-parallel ranks; activations counted unsplit (an upper bound under TP)"
                   if tp is not None else "")
        ep = (f"\n  expert parallelism over {opts.ep_size} ranks: each rank's experts sharded over the "
              f"{n // opts.ep_size} ranks owning them; all-to-all buffers {fmt_bytes(est.exchange)} (one MoE "
              "layer's rows sent and received by dispatch and combine) with a block's backward"
              if experts is not None else "")
        disk = tp_line + ep + context + (f"\n  optimizer state on disk: {fmt_bytes(io[k])} per rank, read and written every step "
                f"through a {fmt_bytes(est.optimizer)} buffer" if on_disk else "")
        if est.disk_read is not None:
            shards_io[k] = (est.disk_read, est.disk_written)
            disk += (f"\n  shards on disk (offload='disk'): {fmt_bytes(est.disk_read)} read and "
                     f"{fmt_bytes(est.disk_written)} written per rank every step; in memory only those in flight "
                     f"({fmt_bytes(est.params)} of shards, {fmt_bytes(est.grads)} of gradient shards)")
        phases = training_phases(plan, est)
        at = max(phases, key=phases.__getitem__)
        pair = "".join(f"\n  {line}" for line in fused_loss_text(section)) if section.found else ""
        beside = f"{fmt_bytes(p.beside)} beside the layers' tensors + " if p.beside else ""
        margin = (f" + margin {fmt_bytes(p.margin)} ({p.margin_fraction:.0%} of the count: {MARGIN_REASON})"
                  if p.margin_fraction else "")
        # Every term of the sum, so that it adds up as printed (docs/design.md "Capacity").
        split = (f"{beside}max(wrapping {fmt_bytes(p.wrapping)} + the process before its first step "
                 f"{fmt_bytes(p.before_first_step)}, training {fmt_bytes(p.training)} at its peak ({at}) + the "
                 f"process baseline {fmt_bytes(p.baseline)}){margin}")
        return p, f"{params:,} parameters: peak per rank {fmt_bytes(p.total)} = {split}" + disk + pair, phases

    if opts.grow or opts.grow_seq:
        # Pipeline stages need a block each: k counts from pp_size x virtual_stages layers up.
        least = (opts.pp_size or 1) * (opts.virtual_stages or 1) - 1
        try:
            k, _ = largest_fitting(lambda k: peak(k + least)[0].total, limit // n, start=8)
        except PlanError as exc:
            raise CLIError(f"--memory {opts.memory} over {n} ranks: {exc}") from None
        k += least
        chosen, detail, phases = peak(k)
    else:
        k = None
        chosen, detail, phases = peak(None)
    value = k * opts.grow_seq if opts.grow_seq and k is not None else k
    grown = "seq_len" if opts.grow_seq else opts.grow
    answer = {"world_size": n, "memory": limit, "limit_per_rank": limit // n, "grow": grown,
              "layers": k if opts.grow else None, "value": value, "cp_size": opts.cp_size, "peak_per_rank": chosen.total, "counted_per_rank": chosen.counted,
              "margin": chosen.margin, "margin_fraction": chosen.margin_fraction, "baseline": chosen.baseline,
              "baseline_before_training": chosen.wrapping_baseline,
              "beside_per_layer": baseline.per_layer, "beside": chosen.beside, "wrapping": chosen.wrapping,
              "fits": chosen.total <= limit // n,
              "training_phases": phases,
              "streaming": opts.streaming, "optimizer_state": opts.optimizer_state or "memory",
              "disk_read_per_step": io.get(k), "disk_written_per_step": io.get(k), "offload": opts.offload,
              "shards_read_per_step": shards_io[k][0] if k in shards_io else None,
              "shards_written_per_step": shards_io[k][1] if k in shards_io else None, "assumes": EXACT_SETTING,
              "pp_size": opts.pp_size, "microbatches": (opts.microbatches or opts.pp_size) if opts.pp_size else None,
              "virtual_stages": (opts.virtual_stages or 1) if opts.pp_size else None,
              "tp_size": opts.tp_size, "ep_size": opts.ep_size, "all_to_all_buffers": exchanged.get(k)}
    if opts.json:
        return json.dumps(answer)
    head = (f"largest {grown}={value} fits {opts.memory} over {n} ranks ({fmt_bytes(limit // n)} per rank)"
            if grown else f"{'fits' if answer['fits'] else 'does not fit'} {opts.memory} over {n} ranks "
                              f"({fmt_bytes(limit // n)} per rank)")
    return (f"{opts.model}: {head}\n  {detail}\n  counts tensors: exact for a job run with {EXACT_SETTING} "
            "(freed tensors leave the process); under glibc's default its heap can hold more (docs/design.md "
            "\"Capacity\")")


def _stages_peak(model: nn.Module, discovery: object, opts: argparse.Namespace, n: int, captured: Capture,
                 budget: int | None, baseline: ProcessBaseline, k: int | None
                 ) -> tuple[ProcessPeak, str, dict[str, int]]:
    """``plan --memory --pp-size P``: the process's peak per rank on the stage that peaks highest under the
    GPipe loop (each stage's shards, its blocks held for the step and their summed gradients, and the
    activations GPipe holds: every micro-batch's), with each stage's peak under GPipe and 1F1B; with
    ``--virtual-stages V``, on the rank (its V stages summed), with each rank's under GPipe and Interleaved1F1B."""
    p, m, v = opts.pp_size, opts.microbatches or opts.pp_size, opts.virtual_stages or 1
    if p < 1 or n % p:
        raise CLIError(f"--pp-size {p} must divide --world-size {n} (stages x data-parallel size)")
    dp = n // p
    plan = build_plan(model, discovery, world_size=dp, prefetch_depth=opts.prefetch_depth,  # type: ignore[arg-type]
                      memory_budget=budget, capture=captured)
    try:
        plan.pipeline = plan_pipeline(model, plan, p, m, captured.graph if captured.method != "none" else None,
                                      activations=captured.activations, virtual=v)
    except (PipelineError, PlanError) as exc:
        raise CLIError(f"{_pp_flags(opts)}: {exc}") from None
    stages = estimate_pipeline(plan, plan.pipeline, dp, captured.activations)
    ranks = rank_estimates(plan.pipeline, stages) if v > 1 else None
    worst, chosen = pipeline_peak(plan, ranks or stages, baseline.resident, built_full=not opts.streaming,
                                  beside=baseline.per_layer * (k - 1) if k is not None else 0,
                                  wrapping_baseline=baseline.before_training, margin_fraction=MARGIN)
    params = sum(g.param_numel() for g in plan.groups)
    margin = f" + margin {fmt_bytes(chosen.margin)} ({chosen.margin_fraction:.0%} of the count: {MARGIN_REASON})"
    where = (f"rank {worst} (stages {', '.join(map(str, plan.pipeline.stages_on(worst)))})" if ranks
             else f"stage {worst}")
    layout = f"{p} ranks x {v} stages" if ranks else f"{p} stages"
    lines = [f"{params:,} parameters in {layout} x data-parallel {dp}, {m} micro-batches: peak per rank "
             f"{fmt_bytes(chosen.total)} on {where} = max(wrapping {fmt_bytes(chosen.wrapping)} + the process "
             f"before its first step {fmt_bytes(chosen.before_first_step)}, training {fmt_bytes(chosen.training)} "
             f"+ the process baseline {fmt_bytes(chosen.baseline)}){margin}"]
    if ranks:
        lines += [f"rank {r.rank}: training {fmt_bytes(r.peak('GPipe'))} under GPipe (model(...), and "
                  f"pipeline_step(schedule='LoopedBFS')), {fmt_bytes(r.peak('Interleaved1F1B'))} under "
                  "Interleaved1F1B" for r in ranks]
        phases = {f"rank {r.rank}": r.peak("GPipe") for r in ranks}
    else:
        lines += [f"stage {e.stage}: training {fmt_bytes(e.peak('GPipe'))} under GPipe (model(...) and "
                  f"pipeline_step(schedule='GPipe')), {fmt_bytes(e.peak('1F1B'))} under 1F1B" for e in stages]
        phases = {f"stage {e.stage}": e.peak("GPipe") for e in stages}
    return chosen, "\n  ".join(lines), phases


def _check_cp(opts: argparse.Namespace, sizes: list[int], inputs: Call | None) -> int:
    """``--cp-size``'s C (1 without it), or ``CLIError`` where the wrapper would refuse it."""
    if getattr(opts, "cp_size", None) is None:
        return 1
    c = opts.cp_size
    if c < 1 or any(n % c for n in sizes):
        raise CLIError(f"--cp-size {c} must divide every --world-size ({sizes})")
    others = [f for f, v in (("--tp-size", opts.tp_size), ("--pp-size", opts.pp_size), ("--ep-size", opts.ep_size),
                             ("--shard-size", opts.shard_size)) if v is not None] + (
        ["--fused-loss"] if opts.fused_loss else [])
    if others:
        raise CLIError(f"--cp-size plans context parallelism with ZeRO-3 only, as cp_size= runs today (#52): drop "
                       f"{', '.join(others)}")
    if inputs is None:
        raise CLIError("--cp-size splits the input's sequence: give one rank's batch, e.g. --input "
                       "input_ids=int64[1,4096] --input labels=int64[1,4096]")
    return c


def _run(opts: argparse.Namespace) -> str:
    if opts.pp_size is not None and (opts.command == "plan" and (opts.shard_size is not None or opts.sequence_parallel)):
        raise CLIError("--pp-size plans pipeline stages with ZeRO-3 (and --tp-size TP) inside each: drop "
                       "--shard-size and --sequence-parallel (their answers do not count stages yet)")
    if opts.pp_size is not None and opts.command == "plan" and opts.memory is not None and (
            opts.optimizer_state == "disk" or opts.offload is not None):
        raise CLIError("--memory with --pp-size counts every stage's shards and optimizer state in memory: drop "
                       "--optimizer-state disk and --offload (or plan without --pp-size)")
    if opts.command == "plan" and opts.ep_size is not None and (
            opts.shard_size is not None or opts.pp_size is not None or opts.sequence_parallel):
        raise CLIError("--ep-size plans expert parallelism beside ZeRO-3 (and --tp-size TP): drop --shard-size, "
                       "--pp-size and --sequence-parallel (their answers do not count experts yet; the wrapper "
                       "refuses ep_size= beside pp_size= and sequence_parallel=True)")
    if opts.microbatches is not None and opts.pp_size is None:
        raise CLIError("--microbatches cuts a pipeline's batch: give --pp-size too")
    if opts.virtual_stages is not None and opts.pp_size is None:
        raise CLIError("--virtual-stages gives each pipeline rank several stages: give --pp-size too")
    if opts.command == "plan" and opts.memory is not None:
        if opts.shard_size is not None or (opts.tp_size is not None and (opts.pp_size is not None
                                                                         or opts.sequence_parallel)):
            # Its peak is ZeRO-3's over the data-parallel ranks (with --tp-size, the split layout's); HSDP, and
            # TP inside pipeline stages or with sequence parallelism, need their layouts in process_peak.
            raise CLIError("--memory answers for ZeRO-3 over every data-parallel rank (with --tp-size, the "
                           "split layout; with --ep-size, each rank's experts over their owners): drop "
                           "--shard-size, and --pp-size or --sequence-parallel beside --tp-size (or run plan "
                           "without --memory for their per-rank estimates)")
        if opts.mixed_precision is not None:
            # Its answer would be for the model without the policy: fp32 masters and gathers in another dtype
            # uncounted (and the model's own dtype under wrapping, which the count takes as the shards').
            raise CLIError("--memory does not count --mixed-precision yet: drop --mixed-precision for the answer "
                           "without it (--dtype bf16 plans a model cast to bf16), or plan without --memory for "
                           "the per-rank estimates under the policy")
        if opts.offload == "host":
            raise CLIError("--memory answers for a CPU process's resident memory, and --offload host plans a CUDA "
                           "job: drop --memory to read its device memory per rank from the estimates (or plan "
                           "a CPU job with --offload disk)")
        return _capacity(opts)
    if opts.command == "plan" and (opts.grow or opts.grow_seq or opts.streaming or opts.baseline or opts.json
                                   or opts.optimizer_state or opts.optimizer_chunk):
        raise CLIError("--grow, --streaming, --baseline, --json and --optimizer-state answer --memory (--grow-seq "
                       "too): give --memory SIZE")
    model = build_model(opts.model)
    inputs = parse_inputs(opts.input)
    if inputs is not None:
        check_inputs(model, inputs)
    budget = parse_bytes(opts.memory_budget) if opts.memory_budget else None
    dtype = _dtype_option(opts.dtype, "--dtype")
    if dtype is not None:
        model = model.to(dtype)  # meta: free; activations are then measured in the training dtype
    mp = None
    if opts.mixed_precision is not None:
        mp = MixedPrecision(param_dtype=_dtype_option(opts.mixed_precision, "--mixed-precision"))
    discovery = discover_blocks(model)
    # Activations are measured in the dtype blocks compute in: param_dtype under mixed precision.
    measured = copy.deepcopy(model).to(mp.param_dtype) if mp is not None else model
    sizes = opts.world_size if opts.command == "plan" else [opts.world_size]
    cp = _check_cp(opts, sizes, inputs) if opts.command == "plan" else 1
    call = pytree.tree_map(mp.cast_input, inputs) if mp is not None else inputs
    captured = capture(measured, discovery, local_call(call, cp) if cp > 1 else call)  # a CP rank's tokens
    if opts.command == "plan" and opts.tp_size is not None and opts.pp_size is None:  # its fused-loss section
        return _tp_report(model, measured, discovery, opts, sizes, captured, inputs, budget, mp)  # needs TP's plan
    section = fused_loss_section(measured, captured, enabled=opts.fused_loss)
    captured = with_fused_loss(captured, section)  # the plan counts the pair's (or the fused op's) bytes
    if section.fused:  # dump draws its node
        captured = replace(captured, graph=fuse_loss(captured.graph, measured, enabled=True)[0])
    if opts.pp_size is not None:
        return _pp_report(model, discovery, opts, sizes, captured, budget, mp)
    experts = _expert_section(model, opts, sizes) if opts.command == "plan" else None
    plans, over = [], []
    for n in sizes:
        try:
            plans.append(build_plan(model, discovery, world_size=n, prefetch_depth=opts.prefetch_depth,
                                    memory_budget=budget, mixed_precision=mp, capture=captured,
                                    offload=opts.offload if opts.command == "plan" else None, experts=experts))
        except MemoryBudgetError as exc:
            over.append(exc)
    if over:
        raise budget_error(budget, over, opts.prefetch_depth)
    if opts.command == "plan" and opts.shard_size is not None:
        sizes, plans = _with_hsdp(model, discovery, opts, sizes, plans, budget, mp, captured)
    if experts is not None:
        return "\n".join([_plan_report(opts, sizes, plans), *_ep_report(experts, sizes, plans, inputs)])
    if opts.command == "plan" and opts.cp_size is not None:
        est = plans[0].estimates[str(sizes[0])]
        section = plan_context_parallel(model, cp, opts.cp_method, call, est.activations,
                                        recomputed=sum(g.checkpoint for g in plans[0].blocks()))
        return "\n".join([_plan_report(opts, sizes, plans), *cp_text(section)])
    if opts.command == "plan":
        return _plan_report(opts, sizes, plans)
    graph = schedule_graph(captured, plans[0])
    if opts.format == "text":
        return render_text(graph, plans[0], opts.verbose)
    return {"json": render_json, "dot": render_dot}[opts.format](graph, plans[0])


def _plan_report(opts: argparse.Namespace, sizes: list[int], plans: list[WrapPlan]) -> str:
    """``bmt-wrap plan``'s output: the model line, one summary line per column, the estimates, the notes."""
    psi = sum(g.param_numel() for g in plans[0].groups)
    dtypes = sorted({b.dtype if b.gather_dtype == b.dtype else f"{b.dtype} gathered as {b.gather_dtype}"
                     for g in plans[0].groups for b in g.buffers})
    experts = plans[0].experts
    split = [by for by, on in (("TP", plans[0].tensor_parallel is not None),
                               ("EP", experts is not None and experts.ep_size > 1)) if on]
    per = f" per {' and '.join(split)} rank" if split else ""
    lines = [f"{opts.model}: {psi:,} parameters{per} ({', '.join(dtypes) or 'none'}), "
             f"{fmt_bytes(sum(g.param_bytes() for g in plans[0].groups))}",
             *(f"N={n}{''.join(map(layout_label, p.estimates.values()))}: {summary_line(p)}"
               for n, p in zip(sizes, plans, strict=True)),
             render_estimates(plans), *(fused_loss_text(plans[0].fused_loss) if plans[0].fused_loss else []),
             *(f"note: {n}" for n in shown_notes(plans[0], opts.verbose))]
    return "\n".join(lines)


def _expert_section(model: nn.Module, opts: argparse.Namespace, sizes: list[int],
                    tp: TensorParallelPlan | None = None) -> ExpertPlan | None:
    """``--ep-size E``'s experts section (None without it), or the error the wrapper would raise: EP borrows E
    of each column's N / T data-parallel ranks (T: ``--tp-size``), and TP splits no expert weight."""
    e, t = opts.ep_size, getattr(opts, "tp_size", None) or 1
    if e is None:
        return None
    bad = [n for n in sizes if e < 1 or n % (e * t)]
    if bad:
        each = f"every --world-size's data-parallel ranks (N / --tp-size {t})" if t > 1 else "every --world-size"
        raise CLIError(f"--ep-size {e} must divide {each}; {bad} do not")
    section = plan_experts(model, e, math.gcd(*(n // t for n in sizes)))
    check_tp_split(section, tp)
    return section


def _ep_report(section: ExpertPlan, sizes: list[int], plans: list[WrapPlan], inputs: Call | None) -> list[str]:
    """``plan --ep-size E``: the experts section, then per world size what each rank holds and sends for
    the experts under EP beside ZeRO-3 without it. Under TP the owners of one EP rank's experts are its
    TP peers too (``MeshLayout.expert_shard_group``), so each rank still holds 1/N of the experts, and each
    TP rank routes the tokens of its data-parallel slice."""
    tokens = token_count(inputs)
    cols = [section.traffic(n, tokens, {g.name for g in p.blocks() if g.checkpoint})
            for n, p in zip(sizes, plans, strict=True)]
    rows = [("", *(f"N={n}" for n in sizes)),
            ("expert bytes per rank (EP)", *(fmt_bytes(c["experts_per_rank"]) for c in cols)),
            ("all-to-all / step (EP)", *(fmt_bytes(c["all_to_all"]) for c in cols)),
            ("experts' ZeRO among owners / step (EP)", *(fmt_bytes(c["ep_zero"]) for c in cols)),
            ("experts' ZeRO-3 gathers / step (no EP)", *(fmt_bytes(c["zero3"]) for c in cols))]
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, width,
                                                                                            strict=True)))
             for r in rows]
    return [*experts_text(section), *table] + (
        [] if tokens else ["note: the all-to-all bytes need --input (token ids) for their token count"])


def _tp_report(model: nn.Module, measured: nn.Module, discovery: object, opts: argparse.Namespace, sizes: list[int],
               captured: Capture, inputs: Call | None, budget: int | None, mp: MixedPrecision | None) -> str:
    """``plan --tp-size T``: per world size N, ZeRO over N/T ranks with the split layout, plus TP traffic; with
    ``--shard-size S`` also the 3-D mesh (N/(S T) replicas x S x T), traffic split by mesh axis and by node."""
    t, s = opts.tp_size, opts.shard_size
    bad = [n for n in sizes if t < 1 or n % t]
    if bad:
        raise CLIError(f"--tp-size {t} must divide every --world-size (data-parallel size x TP size); {bad} do not")
    bad = [n for n in sizes if s is not None and (s < 1 or n % (s * t))]
    if bad:
        raise CLIError(f"--shard-size {s} x --tp-size {t} must divide every --world-size (replicas x shard size x "
                       f"TP size); {bad} do not")
    tp = plan_tensor_parallel(model, t, discovery)  # type: ignore[arg-type]
    experts = _expert_section(model, opts, sizes, tp)
    if opts.sequence_parallel:
        tp.sequence = plan_sequence_parallel(model, tp, discovery)  # type: ignore[arg-type]
        if captured.method == "export":
            tp.sequence = chain_from_capture(tp.sequence, captured.graph)
    # As the wrapper does: a product head cannot read a weight TP splits (passes/fused_loss.py).
    captured = with_fused_loss(captured, fused_loss_section(measured, captured, enabled=opts.fused_loss,
                                                            tensor_parallel=tp))
    tokens = token_count(inputs)
    activations = captured.activations
    plans, columns = [], []
    for n in sizes:
        # TP x DP over every rank, then (--shard-size) the 3-D mesh: HSDP replicas of shard x TP ranks, a
        # node holding one shard group's ranks and their TP peers; each column's traffic split by axis.
        for shard in ([n // t] if s is None else [n // t, s]):
            plan = build_plan(model, discovery, world_size=shard,  # type: ignore[arg-type]
                              prefetch_depth=opts.prefetch_depth, memory_budget=budget, mixed_precision=mp,
                              capture=captured, tensor_parallel=tp, experts=experts)
            est = estimate_tp(plan, shard, tokens, activations) if s is None else \
                estimate_mesh(plan, n, shard, s * t, activations, tokens)
            est.exchange = plan.estimates[str(shard)].exchange  # EP's all-to-all buffers, as the plan counted them
            plan.estimates = {str(shard): with_peak(plan, est)}
            plans.append(plan)
            columns.append(n)
    sizes = columns
    section = [line for line in str(plans[0]).splitlines() if line.startswith(("tensor parallel", "  split",
                                                                                "  heads", "  replicated",
                                                                                "  sequence parallel", "    sp ",
                                                                                "    not sequence parallel"))]
    return "\n".join([_plan_report(opts, sizes, plans), *section]
                     + (_ep_report(experts, sizes, plans, inputs) if experts is not None else [])
                     + ([] if tokens else ["note: TP traffic needs --input (token ids) for its token count"])
                     + (["note: activations are estimated unsplit (an upper bound under TP)"] if activations else []))


def _pp_report(model: nn.Module, discovery: object, opts: argparse.Namespace, sizes: list[int], captured: object,
               budget: int | None, mp: MixedPrecision | None) -> str:
    """``--pp-size P``: per world size N, P stages of ZeRO-3 over N/P ranks each, or with ``--tp-size T`` over
    N/(P T) data-parallel ranks with TP inside (``plan``: the stage table; ``dump``: the graph and the plan with
    its pipeline section)."""
    p, t = opts.pp_size, getattr(opts, "tp_size", None) or 1
    bad = [n for n in sizes if p < 1 or t < 1 or n % (p * t)]
    if bad:
        what = "stages x TP size x data-parallel size" if t > 1 else "stages x data-parallel size"
        raise CLIError(f"--pp-size {p}{f' x --tp-size {t}' if t > 1 else ''} must divide every --world-size "
                       f"({what}); {bad} do not")
    m, v = opts.microbatches or p, opts.virtual_stages or 1
    graph = captured.graph if captured.method != "none" else None  # type: ignore[attr-defined]
    tp = plan_tensor_parallel(model, t, discovery) if t > 1 else None  # type: ignore[arg-type]
    lines, plans = [], []
    for n in sizes:
        dp = n // (p * t)
        plan = build_plan(model, discovery, world_size=dp, prefetch_depth=opts.prefetch_depth,  # type: ignore[arg-type]
                          memory_budget=budget, mixed_precision=mp, capture=captured, tensor_parallel=tp)
        try:
            plan.pipeline = plan_pipeline(model, plan, p, m, graph, virtual=v,
                                          activations=captured.activations)  # type: ignore[attr-defined]
        except (PipelineError, PlanError) as exc:
            raise CLIError(f"{_pp_flags(opts)}: {exc}") from None
        plans.append(plan)
        if opts.command == "plan":
            stages = f"{p} ranks x {v} stages" if v > 1 else f"{p} stages"
            lines += [f"N={n}: {stages} x {f'TP {t} x ' if t > 1 else ''}data-parallel {dp}: {summary_line(plan)}",
                      *pipeline_report(plan.pipeline, estimate_pipeline(
                          plan, plan.pipeline, dp, captured.activations))]  # type: ignore[attr-defined]
    if opts.command == "dump":
        drawn = schedule_graph(captured, plans[0])
        if opts.format == "text":
            return render_text(drawn, plans[0], opts.verbose)
        return {"json": render_json, "dot": render_dot}[opts.format](drawn, plans[0])
    psi = sum(g.param_numel() for g in plans[0].groups)
    per = " per TP rank" if tp is not None else ""
    return "\n".join([f"{opts.model}: {psi:,} parameters{per}, {fmt_bytes(sum(g.param_bytes() for g in plans[0].groups))}",
                      *lines, *pipeline_text(plans[0].pipeline)[1:]])


def _pp_flags(opts: argparse.Namespace) -> str:
    """The pipeline flags as given, for an error's prefix."""
    return f"--pp-size {opts.pp_size}" + (f" --virtual-stages {opts.virtual_stages}" if opts.virtual_stages else "")


def _with_hsdp(model: nn.Module, discovery: object, opts: argparse.Namespace, sizes: list[int],
               plans: list[WrapPlan], budget: int | None, mp: MixedPrecision | None, captured: object
               ) -> tuple[list[int], list[WrapPlan]]:
    """Per world size, ZeRO-3 over every rank then HSDP with shards over ``--shard-size`` ranks, both split
    by nodes of that many ranks."""
    s = opts.shard_size
    bad = [n for n in sizes if s < 1 or n % s]
    if bad:
        raise CLIError(f"--shard-size {s} must divide every --world-size (replicas x shard size); {bad} do not")
    hsdp = build_plan(model, discovery, world_size=s, prefetch_depth=opts.prefetch_depth, memory_budget=budget,
                      mixed_precision=mp, capture=captured)
    activations = captured.activations
    out_sizes, out_plans = [], []
    for n, zero3 in zip(sizes, plans, strict=True):
        for plan, shard in ((zero3, n), (hsdp, s)):
            column = copy.copy(plan)
            column.estimates = {f"{n}/{shard}": with_peak(plan, estimate_mesh(plan, n, shard, s, activations))}
            out_sizes.append(n)
            out_plans.append(column)
    return out_sizes, out_plans


def _dtype_option(text: str | None, option: str) -> torch.dtype | None:
    if text is None:
        return None
    try:
        return to_dtype(text)
    except BMTError as exc:
        raise CLIError(f"bad {option}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``bmt-wrap``; returns the exit status."""
    opts = build_parser().parse_args(argv)
    try:
        print(_run(opts))
    except Exception as exc:
        if opts.debug:
            traceback.print_exc()
        print(f"bmt-wrap: error: {describe(exc) if not isinstance(exc, CLIError) else exc}", file=sys.stderr)
        return 2 if isinstance(exc, CLIError) else 1
    return 0
