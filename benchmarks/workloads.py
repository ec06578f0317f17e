"""The models the benchmarks train: the toy GPT (the README line) and transformers GPT-2 / Llama from configs.

Every workload builds the same weights from the same seed in every process, yields the same global
batches, and names its repeated block list (FSDP wraps each block; the hand-marked plan shards each).
Nothing is downloaded: transformers models are built from configs with random weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from toy_gpt import ToyGPT, ToyGPTConfig, ToyGPTExplicit, token_batches

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Workload:
    """How to build, feed and score one benchmark model."""

    name: str
    describe: str
    build: Callable[[int], nn.Module]  # seq -> seeded model
    blocks: str  # attribute path of the repeated block list
    vocab: int
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    explicit: Callable[[nn.Module], nn.Module] | None = None  # the same model on BMTrain's explicit API
    # The forward call ``loss`` makes on (inputs, targets), as (args, kwargs): what a capture needs.
    call: Callable[[torch.Tensor, torch.Tensor], tuple[tuple, dict]] = lambda idx, tgt: ((), {"input_ids": idx})

    def block_list(self, model: nn.Module) -> nn.ModuleList:
        """The model's repeated blocks."""
        return model.get_submodule(self.blocks)

    def batches(self, steps: int, global_batch: int, seq: int) -> list[Batch]:
        """Deterministic random-token global batches (inputs, next-token targets)."""
        return token_batches(ToyGPTConfig(vocab=self.vocab, seq=seq), steps, batch=global_batch)


def _toy(seq: int) -> nn.Module:
    torch.manual_seed(0)
    return ToyGPT(ToyGPTConfig(seq=seq))


def _toy_small(seq: int) -> nn.Module:
    torch.manual_seed(0)
    return ToyGPT(ToyGPTConfig(vocab=4096, d_model=512, n_layers=4, n_heads=8, seq=seq))


def _toy_deep(seq: int) -> nn.Module:
    torch.manual_seed(0)
    return ToyGPT(ToyGPTConfig(vocab=4096, d_model=256, n_layers=24, n_heads=4, seq=seq))


def _toy_explicit(model: nn.Module) -> nn.Module:
    explicit = ToyGPTExplicit(model.cfg)
    explicit.load_state_dict(model.state_dict())  # full tensors in; every rank keeps its slices
    return explicit


def _gpt2(seq: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    # GPT-2 small (124M, tied embedding), dropout off so every system computes the same losses.
    cfg = GPT2Config(n_positions=max(seq, 64), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


def _llama(seq: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=max(seq, 64))
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _moe_gpt(seq: int) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    # A MoE GPT whose experts hold most of the parameters: 16 experts, top-2, in each of 4 blocks.
    cfg = MixtralConfig(vocab_size=2048, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=4, num_local_experts=16, num_experts_per_tok=2,
                        max_position_embeddings=max(seq, 64))
    torch.manual_seed(0)
    return MixtralForCausalLM(cfg)


def _toy_loss(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return model(idx, tgt)


def _hf_loss(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=idx).logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1))


WORKLOADS: dict[str, Workload] = {
    "toy-gpt": Workload("toy-gpt", "toy GPT: 8 blocks x d_model 1024, vocab 8192, untied head",
                        _toy, "blocks", 8192, _toy_loss, _toy_explicit, lambda idx, tgt: ((idx, tgt), {})),
    "toy-gpt-small": Workload("toy-gpt-small", "toy GPT: 4 blocks x d_model 512, vocab 4096, untied head",
                              _toy_small, "blocks", 4096, _toy_loss, None, lambda idx, tgt: ((idx, tgt), {})),
    "toy-gpt-24": Workload("toy-gpt-24", "toy GPT: 24 blocks x d_model 256, vocab 4096, untied head",
                           _toy_deep, "blocks", 4096, _toy_loss, None, lambda idx, tgt: ((idx, tgt), {})),
    "gpt2": Workload("gpt2", "transformers GPT-2 small config: 12 blocks x 768, vocab 50257, tied",
                     _gpt2, "transformer.h", 50257, _hf_loss),
    "llama": Workload("llama", "transformers Llama config: 6 blocks x 1024 (GQA 16/4), vocab 32000",
                      _llama, "model.layers", 32000, _hf_loss),
    "moe-gpt": Workload("moe-gpt", "transformers Mixtral config: 4 blocks x 256, 16 experts (top-2) of 256 "
                        "each, vocab 2048", _moe_gpt, "model.layers", 2048, _hf_loss),
}
