"""Per-rank memory and per-step communication a plan implies (docs/design.md "Memory per rank").

Model states follow the ZeRO paper: bf16/fp16 shards with Adam keep (2 + 2 + 12)Ψ/N bytes per rank
(low-precision parameter and gradient, fp32 master, momentum and variance); fp32 shards (4 + 4 + 8)Ψ/N,
which is also what ``mixed_precision=`` costs: its fp32 shards are the masters, and only the gathered
parameters (and their communication) are in ``param_dtype``. Every size is the padded shard or gathered
size the runtime actually allocates.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from ..base.dtypes import LOW_PRECISION, itemsize, to_dtype
from ..base.plan import (
    GRADS_IN_FLIGHT,
    HOST_STEP_CHUNK_ELEMS,
    USED_MASK_BYTES,
    MemoryEstimate,
    ShardGroupSpec,
    WrapPlan,
)
from ..errors import PlanError
from .activations import ActivationProfile


def optimizer_bytes_per_elem(dtype: str) -> int:
    """Adam state bytes per parameter element: momentum and variance, plus an fp32 master for fp16/bf16."""
    if to_dtype(dtype) in LOW_PRECISION:
        return 4 + 2 * 4
    return 2 * itemsize(dtype)


def tp_of(plan: WrapPlan) -> int:
    """The plan's tensor-parallel size (1 without TP): buffers marked ``over_tp`` split over N x T ranks."""
    return plan.tensor_parallel.tp_size if plan.tensor_parallel is not None else 1


def _grad_bytes(group: ShardGroupSpec, world_size: int, tp_size: int = 1) -> int:
    return sum(b.full_grad_bytes(b.ranks(world_size, tp_size)) for b in group.buffers if b.requires_grad)


def _padded_bytes(group: ShardGroupSpec, world_size: int, tp_size: int = 1) -> int:
    return sum(b.gathered_bytes(b.ranks(world_size, tp_size)) for b in group.buffers)


def held_gathered(group: ShardGroupSpec, world_size: int, tp_size: int = 1) -> int:
    """Memory a gathered group holds: its full buffers, plus the pooled param_dtype copy of the shard
    that a casting gather sends (mixed precision)."""
    return _padded_bytes(group, world_size, tp_size) + sum(
        b.shard_numel(b.ranks(world_size, tp_size)) * itemsize(b.gather_dtype)
        for b in group.buffers if b.gather_dtype != b.dtype)


def _scale(nbytes: int, world_size: int) -> int:
    """Bytes a rank sends in a ring collective over ``nbytes`` of data: nbytes (N-1)/N."""
    return nbytes * (world_size - 1) // world_size


def gathered_traffic(group: ShardGroupSpec, world_size: int, tp_size: int = 1) -> int:
    """Bytes a rank sends to gather ``group`` once, each buffer over the ranks it is split over."""
    return sum(_scale(b.gathered_bytes(m), m) for b in group.buffers for m in [b.ranks(world_size, tp_size)])


def _reduced_traffic(group: ShardGroupSpec, world_size: int, tp_size: int) -> int:
    """Bytes a rank sends to reduce-scatter ``group``'s gradients once."""
    return sum(_scale(b.full_grad_bytes(m), m) for b in group.buffers if b.requires_grad
               for m in [b.ranks(world_size, tp_size)])


def estimate(plan: WrapPlan, world_size: int, activations: ActivationProfile | None = None) -> MemoryEstimate:
    """Bytes per rank and communicated bytes per training step for ``plan`` on ``world_size`` ranks."""
    n, t = world_size, tp_of(plan)
    est = MemoryEstimate(world_size=n)
    for group in plan.groups:
        for b in group.buffers:
            shard = b.shard_numel(b.ranks(n, t))
            est.params += shard * itemsize(b.dtype)
            if b.requires_grad:
                est.grads += shard * itemsize(b.dtype)
                est.optimizer += shard * optimizer_bytes_per_elem(b.dtype)

    blocks = plan.blocks()
    root = [g for g in plan.groups if g.is_root]

    # zero_level=2 blocks stay gathered from forward to backward; zero-3 blocks cycle through pooled
    # buffers. The pool keeps exact sizes (runtime/buffer_pool.py), so each distinct block size holds the
    # most buffers of it ever in use at once: in backward the block recomputing, the ``depth`` gathered
    # ahead, and the one before, whose storage waits for its gradients (measured: 2, 3, 4 buffers at
    # depth 0, 1, 2; T5's three block sizes hold three sets).
    sizes = {held_gathered(g, n, t) for g in blocks if g.zero_level == 3}
    est.gathered = (sum(held_gathered(g, n, t) for g in root) + (plan.prefetch_depth + 2) * sum(sizes)
                    + sum(held_gathered(g, n, t) for g in blocks if g.zero_level == 2))
    est.grads_in_flight = GRADS_IN_FLIGHT * max((_grad_bytes(g, n, t) for g in blocks), default=0)
    est.no_sync_grads = sum(_grad_bytes(g, n, t) for g in plan.groups)  # runtime/local_grads.py
    if activations is not None:
        root_saved, kept, recompute, objects = activations.parts({g.name for g in blocks if g.checkpoint})
        est.activations = root_saved + kept + recompute + objects
        est.activations_root, est.activations_recompute = root_saved, recompute
        est.activations_objects = objects

    # A zero-3 block is gathered for forward and again for backward; zero_level=2 kept it in between.
    calls = Counter(plan.order or [g.name for g in blocks])
    # Each buffer's traffic over the ranks it is split over (under TP, whole parameters' over N x T).
    est.comm_all_gather = sum(gathered_traffic(g, n, t) for g in root) + sum(
        calls[g.name] * gathered_traffic(g, n, t) * (2 if g.zero_level == 3 else 1) for g in blocks)
    est.comm_reduce_scatter = sum(_reduced_traffic(g, n, t) for g in plan.groups)
    est.zero3_bound = sum(_scale(2 * b.gathered_bytes(m) + b.full_grad_bytes(m), m)
                          for g in plan.groups for b in g.buffers for m in [b.ranks(n, t)])
    # The engine's end-of-backward all-reduce of which parameters got a gradient (one value each).
    trainable = sum(len(b.slots) for g in plan.groups for b in g.buffers if b.requires_grad)
    est.comm_all_reduce = round(2 * trainable * USED_MASK_BYTES * (n - 1) / n)
    return shards_off_device(plan, est) if plan.offload in ("disk", "host") else est


def shards_off_device(plan: WrapPlan, est: MemoryEstimate) -> MemoryEstimate:
    """``est`` with the shards in a file (``offload="disk"``, runtime/offload.py) or in host memory
    (``offload="host"``, runtime/host_store.py: ``est`` then counts the device), and the bytes each rank moves
    per step. Memory keeps only the shards in flight: the blocks' whose gathers the prefetch depth started
    plus the one read ahead (or being gathered), beside the root group's while it is gathered, and the
    gradient shards whose reduce-scatters run; the optimizer holds one buffer's shard and gradient at a time
    (within those). ``no_sync`` sums go off the device too. Each step reads every shard for the forward's
    gathers, again for backward's, and shards and gradient shards for the optimizer; the reduce-scatters write
    the gradient shards, the optimizer the shards. Under ``"host"`` the optimizer's state is on the host as
    well: ``AdamOptimizer`` brings one chunk of each tensor to the device at a time, and its state crosses
    both ways every step."""
    n = est.world_size if est.shard_size is None else est.shard_size
    t = tp_of(plan)
    shard = {g.name: sum(b.shard_numel(b.ranks(n, t)) * itemsize(b.dtype) for b in g.buffers) for g in plan.groups}
    grad = [sum(b.shard_numel(b.ranks(n, t)) * itemsize(b.dtype) for b in g.buffers if b.requires_grad)
            for g in plan.groups]
    block = max((shard[g.name] for g in plan.blocks()), default=0)
    root = max((shard[g.name] for g in plan.groups if g.is_root), default=0)
    # Measured (2 ranks, GPT of width 1024, depth 1): three block shards' pages (72 MiB) mapped at the
    # blocks' backward peak; counting the root's largest shard three times said 97.
    in_flight = max((plan.prefetch_depth + 2) * block, root + (plan.prefetch_depth + 1) * block)
    largest = max(shard.values(), default=0)
    off = replace(est, params=min(est.params, in_flight),
                  grads=min(est.grads, max(GRADS_IN_FLIGHT * max(grad, default=0), largest)), no_sync_grads=0)
    read, written = 3 * est.params + est.grads, est.params + est.grads
    if plan.offload == "disk":
        return replace(off, disk_read=read, disk_written=written)
    per_elem = max((optimizer_bytes_per_elem(b.dtype) for g in plan.groups for b in g.buffers if b.requires_grad),
                   default=0)
    return replace(off, optimizer=min(est.optimizer, HOST_STEP_CHUNK_ELEMS * per_elem),
                   host_to_device=read + est.optimizer, device_to_host=written + est.optimizer)


def estimate_tp(plan: WrapPlan, dp_size: int, tokens: int | None,
                activations: ActivationProfile | None = None, dp_rank: int = 0) -> MemoryEstimate:
    """``estimate`` for ZeRO-3 over ``dp_size`` data-parallel ranks (split parameters in their TP-local shapes),
    plus the TP group's traffic: activations all-reduced and gathered for ``tokens`` tokens per rank (None:
    unknown). Recomputed blocks run their forward collectives twice (forward and recompute), as the runtime does.
    """
    tp = plan.tensor_parallel
    if tp is None:
        raise PlanError("estimate_tp needs a plan with a tensor_parallel section (build_plan(tensor_parallel=))")
    world = dp_size * tp.tp_size
    est = replace(estimate(plan, dp_size, activations), tp_size=tp.tp_size, world_size=world)
    # The end-of-backward all-reduce of which parameters got a gradient runs over the whole job.
    trainable = sum(len(b.slots) for g in plan.groups for b in g.buffers if b.requires_grad)
    est.comm_all_reduce = round(2 * trainable * USED_MASK_BYTES * (world - 1) / world)
    if tokens is None:
        return est
    compute = next((b.gather_dtype for g in plan.groups for b in g.buffers if b.requires_grad), "float32")
    calls = Counter(plan.order or [g.name for g in plan.blocks()])
    traffic = tp.traffic(tokens, itemsize(compute), {g.name for g in plan.blocks() if g.checkpoint}, dict(calls))
    est.comm_tp = sum(traffic.values())
    est.comm_all_reduce += traffic["all_reduce"] + partial_grad_traffic(plan, dp_size, dp_rank)
    est.comm_all_gather += traffic["all_gather"]
    est.comm_reduce_scatter += traffic["reduce_scatter"]
    est.comm_tp += partial_grad_traffic(plan, dp_size, dp_rank)
    return est


def partial_grad_traffic(plan: WrapPlan, dp_size: int, dp_rank: int = 0) -> int:
    """Bytes data-parallel rank ``dp_rank`` all-reduces over the TP group per step to sum the gradients of
    parameters sequence parallelism uses on sequence parts (its shard's part of them; 0 without)."""
    tp = plan.tensor_parallel
    sp = tp.sequence if tp is not None else None
    if sp is None or not sp.enabled or tp.tp_size == 1:
        return 0
    partial, total = set(sp.partial), 0
    for group in plan.groups:
        for buf in group.buffers:
            if not buf.requires_grad or buf.over_tp:  # sharded over shard x tp: scaled by T, not all-reduced
                continue
            elems = sum(b - a for s in buf.slots if s.fqn in partial
                        for a, b in [buf.local_range(s, dp_rank, dp_size)])
            dtype = buf.reduce_dtype or buf.dtype
            if elems:
                total += round(2 * elems * itemsize(dtype) * (tp.tp_size - 1) / tp.tp_size)
    return total


def estimate_mesh(plan: WrapPlan, world_size: int, shard_size: int, ranks_per_node: int,
                  activations: ActivationProfile | None = None, tokens: int | None = None,
                  shard_rank: int = 0) -> MemoryEstimate:
    """``estimate`` for shards over ``shard_size`` ranks and ``world_size // (shard_size x T)`` replicas (HSDP; a
    shard size equal to the world is ZeRO-3), with its traffic split by mesh axis and by nodes of
    ``ranks_per_node`` ranks. A plan with a tensor-parallel section is a 3-D mesh (replicate, shard, tp):
    TP over T adjacent ranks, its activations' traffic (``estimate_tp``) for ``tokens`` tokens per rank (and
    shard rank ``shard_rank``'s part of the sequence-parallel gradient sums).

    Memory and the all-gathers and reduce-scatters are ZeRO-3's over the shard group (``comm_shard``). Each
    reduce-scatter's shard is then averaged across replicas: one all-reduce of the gradient shard
    (``comm_replicas``). A collective over a group that lies within one node counts as intra-node; over a
    group that spans nodes, every byte counts as inter-node (ZeRO++'s accounting: a ring over several nodes
    moves its whole volume across them).
    """
    t = plan.tensor_parallel.tp_size if plan.tensor_parallel is not None else 1
    if shard_size < 1 or world_size % (shard_size * t):
        raise PlanError(f"shard size {shard_size}{f' x tp size {t}' if t > 1 else ''} must divide the world "
                        f"size {world_size} (replicas x shard size{' x tp size' if t > 1 else ''})")
    if ranks_per_node < 1:
        raise PlanError(f"ranks per node must be >= 1, got {ranks_per_node}")
    zero = estimate(plan, shard_size, activations)
    est = estimate_tp(plan, shard_size, tokens, activations, shard_rank) if t > 1 else zero
    replicas = world_size // (shard_size * t)
    grad_shards = sum(b.shard_numel(b.ranks(shard_size, t)) * itemsize(b.grad_dtype)
                      for g in plan.groups for b in g.buffers if b.requires_grad)
    trainable = sum(len(b.slots) for g in plan.groups for b in g.buffers if b.requires_grad)
    est.world_size, est.shard_size = world_size, shard_size
    est.comm_shard = zero.comm_all_gather + zero.comm_reduce_scatter
    est.comm_replicas = 2 * grad_shards * (replicas - 1) // replicas
    mask = round(2 * trainable * USED_MASK_BYTES * (world_size - 1) / world_size)  # over the whole job
    # TP's all-reduces: what its traffic holds beyond the activations' gathers and reduce-scatters
    tp_all_reduce = ((est.comm_tp or 0) - (est.comm_all_gather - zero.comm_all_gather)
                     - (est.comm_reduce_scatter - zero.comm_reduce_scatter))
    est.comm_all_reduce = est.comm_replicas + mask + tp_all_reduce
    # A shard group strides over the TP peers: it spans shard_size x t consecutive ranks.
    shard_spans_nodes = shard_size * t > ranks_per_node
    job_spans_nodes = world_size > ranks_per_node  # the replicate group and the mask's group: the whole job's span
    tp_spans_nodes = t > ranks_per_node
    est.comm_inter_node = ((est.comm_shard if shard_spans_nodes else 0) + ((est.comm_tp or 0) if tp_spans_nodes else 0)
                           + (est.comm_replicas + mask if job_spans_nodes else 0))
    est.comm_intra_node = est.comm_total - est.comm_inter_node
    return est
