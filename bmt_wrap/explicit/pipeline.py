"""BMTrain's ``PipelineTransformerBlockList``: its blocks split over the pipeline stages of
``init_distributed(pipe_size=P)``, run GPipe-style (every micro-batch's forward, then every backward).

Each stage keeps its own blocks, ZeRO-3 sharded over its data-parallel ranks; the others become ghosts
(full shapes over empty ranges: ``Engine.ghost_group``), so a rank holds only its stage's blocks. The
stages of a pipeline take the same batch (``bmt.data_parallel_rank()``; BMTrain instead gathers every
stage's batch first): the first stage computes from the list's input, each stage hands its activations to
the next, and every stage returns the last stage's output, so the code after the list runs alike on every
stage and the loss each rank returns is the whole batch's. Gradients are DDP's over the data-parallel ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import PipelineError
from ..job.distributed import get_state, parallel_layout
from ..job.tp_inputs import check_pipeline_inputs_agree
from ..runtime.active_engine import get_engine
from ..runtime.comm import StagePlacement
from ..runtime.pipeline import (
    Ends,
    Hop,
    RecvActivations,
    SendActivations,
    ShareInputGrads,
    ShareOutput,
    anchor,
)
from .block import TransformerBlockList


class PipelineTransformerBlockList(TransformerBlockList):
    """``(modules, num_hidden=1)``: the blocks split over ``pipe_size`` stages in order, the first
    ``len % P`` stages one block more (BMTrain's split); ``forward(*args, return_hidden_states=False,
    **kwargs)`` as ``TransformerBlockList``'s, the batch (dim 0 of the flowing inputs, and of other tensor
    arguments of that size) cut into ``bmt.config["micros"]`` micro-batches. As in BMTrain, blocks passed
    in must be made with ``mode="PIPE"``."""

    _block_mode = "PIPE"

    def __init__(self, modules: list[nn.Module] | nn.ModuleList, num_hidden: int = 1) -> None:
        super().__init__(modules, num_hidden)
        layout = parallel_layout()
        self.stages, self.stage_id = layout.pp_size, layout.pp_rank
        self.layer_ids = self.get_range_by_stage_id(self.stage_id)
        if self.stages == 1:
            return
        if len(self) < self.stages:
            raise PipelineError(f"a PipelineTransformerBlockList of {len(self)} block(s) over {self.stages} "
                                "pipeline stages: every stage needs a block; use pipe_size <= the number of "
                                "blocks")
        engine = get_engine()
        assert layout.pp is not None
        for i, block in enumerate(self):
            group = block._bmt_group
            owner = self.get_stage_by_layer_id(i)
            placement = StagePlacement(layout.pp, owner)
            if owner == self.stage_id:
                engine.place_on_stage(group, placement)
                continue
            ghost = engine.ghost_group(group.spec, group.locations, placement, group.buffers[0].shard.device)
            for real, fake in zip(group.buffers, ghost.buffers, strict=True):
                for p, g in zip(real.params, fake.params, strict=True):
                    g._init_method = p._init_method  # init_parameters draws it anyway: the RNG stays in step
            engine.forget(group)  # its shards go: this rank holds only its own stage's blocks
            block._bmt_group = ghost

    # ---- BMTrain's stage arithmetic --------------------------------------------------------------------
    def get_part_len_by_stage_id(self, stage_id: int) -> int:
        """How many blocks stage ``stage_id`` runs."""
        return len(self) // self.stages + (stage_id < len(self) % self.stages)

    def get_range_by_stage_id(self, stage_id: int) -> range:
        """The indices of stage ``stage_id``'s blocks."""
        start = sum(self.get_part_len_by_stage_id(s) for s in range(stage_id))
        return range(start, start + self.get_part_len_by_stage_id(stage_id))

    def get_stage_by_layer_id(self, layer_id: int) -> int:
        """The stage that runs block ``layer_id``."""
        return next(s for s in range(self.stages) if layer_id in self.get_range_by_stage_id(s))

    # ---- running -----------------------------------------------------------------------------------------
    def forward(self, *args: Any, return_hidden_states: bool = False, **kwargs: Any) -> Any:
        """Run every block in order, each on its stage, micro-batch by micro-batch."""
        if self.stages == 1:
            return super().forward(*args, return_hidden_states=return_hidden_states, **kwargs)
        if return_hidden_states:
            raise PipelineError("return_hidden_states=True across pipeline stages is not supported: each "
                                "stage holds its own blocks' inputs. Record what you need with "
                                "bmt.inspect.record_tensor inside a block, or use pipe_size=1")
        layout = parallel_layout()
        assert layout.pp is not None
        ends = Ends(layout.pp, f"pipeline {self._bmt_label()}")
        hidden, rest = list(args[:self.num_hidden]), list(args[self.num_hidden:])
        micros = get_state().micro_batches or self.stages
        batch = _batch_size(hidden, micros)
        check_pipeline_inputs_agree([t for t in [*hidden, *rest, *kwargs.values()] if torch.is_tensor(t)],
                                    f"{type(self).__name__}.forward's inputs")
        tensors = [*hidden, *[a for a in rest if torch.is_tensor(a)]]
        # The inputs' gradients: the first stage's for what flows, every stage's summed for what each reads.
        input_token = None
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            shared = list(ShareInputGrads.apply(ends, len(hidden), *tensors))
            hidden, it = shared[:len(hidden)], iter(shared[len(hidden):])
            rest = [next(it) if torch.is_tensor(a) else a for a in rest]
            input_token = hidden[0].reshape(-1)[:0]
        parts, outputs = [], []
        device = hidden[0].device
        for m in range(micros):
            hop = Hop(ends.comm, self.stage_id - 1, m, ends.label)
            if ends.first:
                flow = [h.chunk(micros)[m] for h in hidden]
            else:
                flow = list(RecvActivations.apply(hop, anchor(device)))
            extra = [_micro(a, batch, micros, m) for a in rest]
            kw = {k: _micro(v, batch, micros, m) for k, v in kwargs.items()}
            for i in self.layer_ids:
                out = self[i](*flow, *extra, **kw)
                flow = list(out) if isinstance(out, tuple) else [out]
                flow = flow[:self.num_hidden]
            if ends.last:
                outputs.append(flow)
            else:
                parts.append(SendActivations.apply(Hop(ends.comm, self.stage_id + 1, m, ends.label), *flow))
        whole = [torch.cat([o[i] for o in outputs]) for i in range(self.num_hidden)] if ends.last else []
        extra_parts = [input_token] if input_token is not None else []
        result = ShareOutput.apply(ends, len(whole), *whole, *parts, *extra_parts)
        return tuple(result) if self.num_hidden > 1 else result[0]

    def _bmt_label(self) -> str:
        return f"of {len(self)} blocks"


def _batch_size(hidden: list[Any], micros: int) -> int:
    if not hidden or not torch.is_tensor(hidden[0]) or hidden[0].dim() == 0:
        raise PipelineError("a PipelineTransformerBlockList's first argument is the batch's hidden states, a "
                            "tensor whose dim 0 is the batch")
    batch = hidden[0].shape[0]
    if batch % micros:
        raise PipelineError(f"a batch of {batch} cannot be cut into {micros} micro-batches "
                            "(bmt.init_distributed(num_micro_batches=), default pipe_size): pass a batch "
                            "divisible by it, or another num_micro_batches")
    return batch


def _micro(value: Any, batch: int, micros: int, m: int) -> Any:
    """Micro-batch ``m``'s part of an argument: a tensor whose dim 0 is the batch is cut, others pass whole."""
    if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == batch:
        return value.chunk(micros)[m]
    return value
