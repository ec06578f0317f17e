"""bmt_wrap's exception types: every error we raise names what is wrong and how to fix it."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def listed(items: Sequence[object], limit: int = 5, fmt: Callable[[object], str] = repr, sep: str = ", ") -> str:
    """The first ``limit`` items for an error message, ending ``… and N more`` when there are more."""
    more = f" … and {len(items) - limit} more" if len(items) > limit else ""
    return sep.join(fmt(x) for x in items[:limit]) + more


class BMTError(RuntimeError):
    """Base class of every error bmt_wrap raises on purpose."""


class NotInitializedError(BMTError):
    """A distributed function was called before ``bmt.init_distributed()``."""


NOT_INITIALIZED = ("bmt_wrap's distributed state is not initialised: call bmt.init_distributed() first "
                   "(under torchrun it reads RANK/WORLD_SIZE; without them it runs as a single process).")


class InitError(BMTError):
    """``init_distributed`` or parameter initialisation could not do what was asked."""


class CommError(BMTError):
    """A collective failed."""


class CommTimeoutError(CommError):
    """A collective did not complete in time; the process group is unusable afterwards."""


class PeerLostError(CommTimeoutError):
    """Another rank died or tore its group down during a collective; fatal like a timeout."""


class CollectiveMismatchError(CommError):
    """Ranks issued different collectives (a block skipped or repeated on some ranks)."""


class WrapError(BMTError):
    """A model cannot be wrapped as asked, or a wrapped model was used in an unsupported way."""


class MeshError(WrapError):
    """A ``mesh=`` that cannot shard this job: wrong dimensions or names, not covering every rank, or built
    differently on different ranks."""


class ShardedTensorError(WrapError):
    """An operation a sharded parameter (one rank's range of the full tensor) cannot answer locally."""


class ModelMismatchError(WrapError):
    """Ranks wrap different models (or pass different ``plan=``/``example_inputs=``); raised on every rank
    before any collective depends on the model, so the process group stays usable."""


class PlanError(BMTError):
    """A plan is invalid for this model, or a layout decision needs inputs it was not given."""


class TensorParallelPlanError(PlanError):
    """A tensor-parallel plan cannot split this model: sizes (heads, features, vocabulary) not divisible by the
    TP size, or a ``tp_plan=`` naming a module the model does not have; raised before the model changes."""


class ExpertParallelError(PlanError):
    """Expert parallelism cannot split this model as asked: ``ep_size`` not dividing a layer's experts or the
    data-parallel ranks, no mixture-of-experts layer found, or an expert weight shared outside its experts;
    raised on every rank before the model changes."""


class MemoryBudgetError(PlanError):
    """``memory_budget=`` is below what the plan needs with every block recomputed and resharded.

    ``needed`` is the smallest budget that plan meets (bytes per rank), ``activations_known`` whether that
    includes activations. Built from the message alone when it crosses ranks (``agree``), so both are
    optional.
    """

    def __init__(self, message: str, *, needed: int | None = None, world_size: int | None = None,
                 activations_known: bool = True) -> None:
        super().__init__(message)
        self.needed, self.world_size, self.activations_known = needed, world_size, activations_known


class RecomputeError(WrapError):
    """A checkpointed block's recompute cannot reproduce its forward (outputs differ, or state it changed
    cannot be restored); raised instead of computing a wrong gradient."""


class ParityError(WrapError):
    """``model.verify`` found the wrapped model outside tolerance of its plain reference."""


class UninitializedParameterError(WrapError):
    """A parameter is still on the meta device when it is needed."""


class OptimizerError(BMTError):
    """An optimizer or loss scaler was misused."""


class OffloadError(BMTError):
    """Shards offloaded to a file (``offload="disk"``) cannot be placed or read: no space, a file truncated or
    replaced, or an offload this device does not support. Raised on every rank of the job alike."""


class GradSyncError(BMTError):
    """Gradients accumulated unreduced under ``no_sync`` would be lost or misused (an optimizer step or
    clipping before the synchronising backward, an in-place change to ``.grad`` inside the window)."""


class CheckpointError(BMTError):
    """A checkpoint file or directory cannot be written or read."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file's bytes differ from what the save wrote (its checksum does not match)."""


class TensorParallelError(BMTError):
    """Tensor parallelism cannot run as asked (raised alike on every rank of the TP group)."""


class TPShapeError(TensorParallelError, ValueError):
    """A dimension tensor parallelism splits is not divisible by the tensor-parallel size."""


class TPInputMismatchError(TensorParallelError):
    """The ranks of one tensor-parallel group were given different inputs (they must share each batch)."""


class ContextParallelError(BMTError, ValueError):
    """Context parallelism cannot split this input or attention as asked: a sequence that does not divide
    into 2 x cp_size chunks, Ulysses forced with fewer heads than ranks, or a mask the split cannot cut
    exactly (raised alike on every rank of the CP group)."""


class PipelineError(BMTError):
    """Pipeline parallelism cannot run as asked, or a stage failed (raised on every rank of the pipeline)."""


class PipelineInputMismatchError(PipelineError):
    """The stages of one pipeline were given different inputs (they must share each batch)."""


class PipelineScheduleError(PipelineError):
    """``model.pipeline_step(schedule=...)`` names a schedule it does not offer (the message lists those it does)."""


class CLIError(BMTError):
    """Bad command-line input."""


class UnsupportedError(BMTError, NotImplementedError):
    """A BMTrain feature bmt_wrap does not implement (NCCL handles, ...)."""


class BlockListError(WrapError, AssertionError):
    """A block list cannot hold a block as given (one ``Block`` twice, a non-pipeline block in a pipeline
    list). Also an ``AssertionError``: BMTrain raises that, and code written for it catches it."""


class MaterializeWarning(UserWarning):
    """An op on a sharded tensor needed its full value and gathered it (a collective on every rank), once
    per kind of op; ``bmt.comm_stats()["materialize"]`` counts every such gather."""


class FusedLossWarning(UserWarning):
    """Under ``fused_loss=True`` the vocabulary head's logits met an op the chunked loss does not replay,
    and were computed whole: the result is the unfused model's, the memory is not saved."""


class OffloadWarning(UserWarning):
    """An offload that saves less memory than it seems to: ``offload_dir`` on a filesystem held in memory
    (tmpfs), or an optimizer keeping its state in memory beside ``offload="disk"``."""
