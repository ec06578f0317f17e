"""Small, deterministic test models shared by the pass, engine and wrapper tests.

Every factory function (lowercase, and the ``TOY``/``HF`` catalogues) builds the same weights on every
call (a fixed seed inside a forked RNG, so the caller's RNG is untouched); calling a class directly
uses the caller's RNG. Everything works under ``with torch.device("meta")``. Transformers models are built from tiny
configs (nothing is downloaded) with dropout off, so wrapped and plain runs can be compared exactly.
Each toy model documents which blocks discovery must find: tests assert exactly that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 96
DIM = 32
SEQ = 16


def seeded(build: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    """Run ``build`` under ``seed`` without disturbing the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


# ---- toy transformer pieces -----------------------------------------------------------------------
class Attention(nn.Module):
    """Causal self-attention with separate q/k/v/o projections (same-shape siblings that are never blocks)."""

    def __init__(self, dim: int = DIM, heads: int = 4) -> None:
        super().__init__()
        # Head count and width as attributes the forward reshapes with (as transformers' attentions do), so
        # tensor parallelism can set the head count to each TP rank's share.
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        src = x if memory is None else memory

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, -1, self.heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(src)), split(self.v(src)),
                                             is_causal=memory is None)
        return self.o(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class Block(nn.Module):
    """Pre-norm transformer block: the repeated unit of every toy transformer."""

    def __init__(self, dim: int = DIM, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        # Residual dropout after each sublayer (GPT-2's resid_pdrop), only when asked for.
        self.drop = nn.Dropout(dropout) if dropout else None

    def _residual(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.drop is None else self.drop(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._residual(self.attn(self.ln1(x)))
        return x + self._residual(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class DecoderBlock(Block):
    """Block with cross-attention to an encoder's output (a different signature from ``Block``)."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__(dim)
        self.ln_x = nn.LayerNorm(dim)
        self.cross = Attention(dim)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = x + self.attn(self.ln1(x))
        x = x + self.cross(self.ln_x(x), memory)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


# ---- toy models -----------------------------------------------------------------------------------
class ToyGPT(nn.Module):
    """Blocks: ``layers.0 .. layers.{n-1}`` (a ModuleList). ``tie=True`` ties ``head.weight`` to ``embed.weight``;
    ``dropout=p``: residual dropout in each block."""

    def __init__(self, n_layers: int = 4, dim: int = DIM, vocab: int = VOCAB, tie: bool = False,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(SEQ * 4, dim) * 0.02)
        self.layers = nn.ModuleList(Block(dim, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:  # a tied LM's shared weight is initialised as its head (GPT-2: std 0.02), not as N(0, 1)
            nn.init.normal_(self.embed.weight, std=0.02)
            self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.ln_f(x))
        if targets is not None:
            return lm_loss(logits, targets)
        return logits


class ListExperts(nn.ModuleList):
    """Experts as users write them: a ModuleList of MLPs, called with each token's top-k indices and weights."""

    def __init__(self, dim: int, num: int) -> None:
        super().__init__(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                         for _ in range(num))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, expert in enumerate(self):
            rows, slot = torch.where(idx == e)
            out = out.index_add(0, rows, expert(x[rows]) * weights[rows, slot, None])
        return out


class ListMoE(nn.Module):
    """A top-2 MoE layer: a linear router (``gate``) and ``ListExperts``."""

    def __init__(self, dim: int = DIM, num: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num, bias=False)
        self.experts = ListExperts(dim, num)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, idx = torch.topk(self.gate(flat).softmax(-1), 2, dim=-1)
        return self.experts(flat, idx, weights).reshape(x.shape)


class ListMoEBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.moe = ListMoE(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.ln(x))


class ListMoEGPT(nn.Module):
    """An attention-free LM whose blocks (``layers.0``, ``layers.1``) are ``ListMoE`` layers: 4 experts in a
    ModuleList each, top-2."""

    def __init__(self, dim: int = 16, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(ListMoEBlock(dim) for _ in range(2))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return logits if targets is None else lm_loss(logits, targets)


class FunctionalTiedGPT(ToyGPT):
    """No head module: the root's forward computes the logits as ``F.linear(h, self.embed.weight)`` (OLMo's
    tied head, as many research models write it). Blocks: ``layers.0``, ``layers.1``."""

    def __init__(self, n_layers: int = 2) -> None:
        super().__init__(n_layers=n_layers, tie=True)
        del self.head

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        logits = F.linear(self.ln_f(x), self.embed.weight)
        return logits if targets is None else lm_loss(logits, targets)


class SequentialGPT(nn.Sequential):
    """The whole model is one ``nn.Sequential``. Blocks: ``1``, ``2``, ``3``."""

    def __init__(self, n_layers: int = 3, dim: int = DIM, vocab: int = VOCAB) -> None:
        super().__init__(nn.Embedding(vocab, dim), *(Block(dim) for _ in range(n_layers)),
                         nn.LayerNorm(dim), nn.Linear(dim, vocab))


class DictGPT(nn.Module):
    """Blocks in a ``ModuleDict``: ``blocks.first``, ``blocks.second``, ``blocks.third``."""

    def __init__(self, dim: int = DIM, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleDict({k: Block(dim) for k in ("first", "second", "third")})
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x)


class NestedListGPT(nn.Module):
    """Layers in a list of lists (Funnel's encoder): the inner lists are never called, their layers are the
    blocks ``stages.0.0 .. stages.1.1``."""

    def __init__(self, dim: int = DIM, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.stages = nn.ModuleList(nn.ModuleList(Block(dim) for _ in range(2)) for _ in range(2))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return self.head(x)


class AttrGPT(nn.Module):
    """Blocks as plain attributes ``block0 .. block{n-1}`` of the model itself."""

    def __init__(self, n_layers: int = 3, dim: int = DIM, vocab: int = VOCAB) -> None:
        super().__init__()
        self.n_layers = n_layers
        self.embed = nn.Embedding(vocab, dim)
        for i in range(n_layers):
            setattr(self, f"block{i}", Block(dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for i in range(self.n_layers):
            x = getattr(self, f"block{i}")(x)
        return self.head(x)


class EncoderDecoder(nn.Module):
    """Two block lists: ``encoder.0..`` (``Block``) and ``decoder.0..`` (``DecoderBlock``); shared embedding."""

    def __init__(self, n_enc: int = 2, n_dec: int = 2, dim: int = DIM, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.ModuleList(Block(dim) for _ in range(n_enc))
        self.decoder = nn.ModuleList(DecoderBlock(dim) for _ in range(n_dec))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        memory = self.embed(input_ids)
        for layer in self.encoder:
            memory = layer(memory)
        x = self.embed(decoder_input_ids)
        for layer in self.decoder:
            x = layer(x, memory)
        return self.head(x)


class SharedLayerGPT(ToyGPT):
    """``layers.0`` is called twice per forward (first and last): block order has it twice."""

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        x = self.layers[0](x)
        logits = self.head(self.ln_f(x))
        return logits if targets is None else lm_loss(logits, targets)


class CrossTiedGPT(ToyGPT):
    """Every block's ``fc1.weight`` is one Parameter: used by several blocks, so it belongs to the root."""

    def __init__(self, n_layers: int = 3) -> None:
        super().__init__(n_layers=n_layers)
        for layer in self.layers[1:]:
            layer.fc1.weight = self.layers[0].fc1.weight


class MLP(nn.Module):
    """No repeated blocks: different widths everywhere, so everything stays in the root group."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 24), nn.ReLU(), nn.Linear(24, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class BasicBlock(nn.Module):
    """ResNet basic block; the stage's first block changes width and carries a downsample path."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=c_out // c_in, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        if c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=2, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        skip = self.downsample(x) if hasattr(self, "downsample") else x
        return F.relu(y + skip)


class ResNetStage(nn.Module):
    """Blocks: ``stage.0`` (downsampling, near-identical), ``stage.1``, ``stage.2``."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.stage = nn.Sequential(BasicBlock(width, 2 * width), BasicBlock(2 * width, 2 * width),
                                   BasicBlock(2 * width, 2 * width))
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.stage(F.relu(self.stem(x))).mean(dim=(2, 3)))


# ---- transformers models from tiny configs --------------------------------------------------------
def _hf_small() -> dict[str, Any]:
    return dict(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def gpt2() -> nn.Module:
    """transformers GPT2LMHeadModel, 2 layers, tied embedding (``transformer.h.0``, ``transformer.h.1``)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=DIM, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return seeded(lambda: GPT2LMHeadModel(cfg))


def llama() -> nn.Module:
    """transformers LlamaForCausalLM, 2 layers (``model.layers.0``, ``model.layers.1``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return seeded(lambda: LlamaForCausalLM(LlamaConfig(**_hf_small())))


def llama_self_checkpointing() -> nn.Module:
    """``llama()`` with transformers' own gradient checkpointing on, as a user enables it before wrapping."""
    model = llama()
    model.activation_checkpointing_enable()
    return model


def mistral() -> nn.Module:
    """transformers MistralForCausalLM, 2 layers."""
    from transformers import MistralConfig, MistralForCausalLM

    return seeded(lambda: MistralForCausalLM(MistralConfig(**_hf_small(), sliding_window=None)))


def qwen2() -> nn.Module:
    """transformers Qwen2ForCausalLM, 2 layers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return seeded(lambda: Qwen2ForCausalLM(Qwen2Config(**_hf_small())))


def _moe_small() -> dict[str, Any]:
    return dict(_hf_small(), num_local_experts=4, num_experts_per_tok=2)


def mixtral(num_hidden_layers: int = 2) -> nn.Module:
    """transformers MixtralForCausalLM, 2 layers, 4 packed experts each, top-2 (``model.layers.*.mlp``)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return seeded(lambda: MixtralForCausalLM(MixtralConfig(**{**_moe_small(), "num_hidden_layers": num_hidden_layers})))


def qwen3_moe(num_hidden_layers: int = 2) -> nn.Module:
    """transformers Qwen3MoeForCausalLM, 2 layers, 4 packed experts each, top-2."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = dict(_moe_small(), moe_intermediate_size=32, head_dim=8, num_hidden_layers=num_hidden_layers)
    return seeded(lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)))


def qwen2_moe() -> nn.Module:
    """transformers Qwen2MoeForCausalLM, 2 layers, 4 packed experts and a gated shared expert each, top-2."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = dict(_moe_small(), num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64)
    return seeded(lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(**cfg)))


def deepseek_v3(num_hidden_layers: int = 2) -> nn.Module:
    """transformers DeepseekV3ForCausalLM, 2 layers: layer 0 dense (``first_k_dense_replace=1``), layer 1
    4 routed experts (top-2 of 2 groups) beside a shared expert; with one layer, that MoE layer alone."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = dict(_hf_small(), n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2,
               topk_group=1, first_k_dense_replace=min(1, num_hidden_layers - 1), kv_lora_rank=16, q_lora_rank=24,
               qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, num_hidden_layers=num_hidden_layers)
    return seeded(lambda: DeepseekV3ForCausalLM(DeepseekV3Config(**cfg)))


def gpt_oss(top_k: int = 2, num_hidden_layers: int = 2) -> nn.Module:
    """transformers GptOssForCausalLM, 2 layers, 4 packed experts with biases each, top-``top_k``."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = dict(_moe_small(), head_dim=8, num_experts_per_tok=top_k, num_hidden_layers=num_hidden_layers)
    return seeded(lambda: GptOssForCausalLM(GptOssConfig(**cfg)))


def list_moe() -> nn.Module:
    """``ListMoEGPT``: experts held as a ModuleList of MLPs in each of its two blocks."""
    return seeded(ListMoEGPT)


def bert() -> nn.Module:
    """transformers BertForSequenceClassification, 2 layers (``bert.encoder.layer.0``, ``.1``), 3 labels."""
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=64, num_labels=3,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return seeded(lambda: BertForSequenceClassification(cfg))


def t5() -> nn.Module:
    """transformers T5ForConditionalGeneration, 3+3 layers: block 0 of each stack carries the relative bias."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=DIM, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=3,
                   num_heads=4, dropout_rate=0.0, decoder_start_token_id=0)
    return seeded(lambda: T5ForConditionalGeneration(cfg))


class Classifier(nn.Module):
    """A user module around a transformers model: blocks ``backbone.layers.0``, ``backbone.layers.1``."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaModel

        self.backbone = LlamaModel(LlamaConfig(**_hf_small()))
        self.head = nn.Linear(DIM, classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids).last_hidden_state
        return self.head(hidden[:, -1])


def classifier() -> nn.Module:
    """A seeded ``Classifier``."""
    return seeded(Classifier)


def llama_7b() -> nn.Module:
    """Llama-2-7B's architecture (32 layers, 4096 wide); build it under ``torch.device("meta")``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)
    return LlamaForCausalLM(cfg)


# ---- catalogue: name -> (factory, example inputs as (args, kwargs), expected blocks) ---------------
def token_ids(batch: int = 2, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    """Deterministic token ids in ``[0, VOCAB)``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def _ids_kw(*names: str) -> Callable[[], tuple[tuple, dict[str, torch.Tensor]]]:
    return lambda: ((), {n: token_ids(seed=i) for i, n in enumerate(names)})


def _ids_pos() -> tuple[tuple, dict]:
    return (token_ids(),), {}


TOY: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[tuple, dict]], list[str]]] = {
    "toy_gpt": (lambda: seeded(ToyGPT), _ids_pos, [f"layers.{i}" for i in range(4)]),
    "tied_gpt": (lambda: seeded(lambda: ToyGPT(tie=True)), _ids_pos, [f"layers.{i}" for i in range(4)]),
    "sequential": (lambda: seeded(SequentialGPT), _ids_pos, ["1", "2", "3"]),
    "module_dict": (lambda: seeded(DictGPT), _ids_pos, ["blocks.first", "blocks.second", "blocks.third"]),
    "nested_lists": (lambda: seeded(NestedListGPT), _ids_pos, [f"stages.{i}.{j}" for i in range(2) for j in range(2)]),
    "attributes": (lambda: seeded(AttrGPT), _ids_pos, ["block0", "block1", "block2"]),
    "encoder_decoder": (lambda: seeded(EncoderDecoder), lambda: ((token_ids(), token_ids(seed=1)), {}),
                        ["encoder.0", "encoder.1", "decoder.0", "decoder.1"]),
    "shared_layer": (lambda: seeded(SharedLayerGPT), _ids_pos, [f"layers.{i}" for i in range(4)]),
    "cross_tied": (lambda: seeded(CrossTiedGPT), _ids_pos, ["layers.0", "layers.1", "layers.2"]),
    "mlp": (lambda: seeded(MLP), lambda: ((torch.randn(2, 16, generator=torch.Generator().manual_seed(0)),), {}),
            []),
    "resnet_stage": (lambda: seeded(ResNetStage),
                     lambda: ((torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0)),), {}),
                     ["stage.0", "stage.1", "stage.2"]),
}

HF: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[tuple, dict]], list[str]]] = {
    "gpt2": (gpt2, _ids_kw("input_ids"), ["transformer.h.0", "transformer.h.1"]),
    "llama": (llama, _ids_kw("input_ids"), ["model.layers.0", "model.layers.1"]),
    "mistral": (mistral, _ids_kw("input_ids"), ["model.layers.0", "model.layers.1"]),
    "qwen2": (qwen2, _ids_kw("input_ids"), ["model.layers.0", "model.layers.1"]),
    "bert": (bert, _ids_kw("input_ids"), ["bert.encoder.layer.0", "bert.encoder.layer.1"]),
    "t5": (t5, _ids_kw("input_ids", "decoder_input_ids"),
           [f"{s}.block.{i}" for s in ("encoder", "decoder") for i in range(3)]),
    "classifier": (classifier, _ids_pos, ["backbone.layers.0", "backbone.layers.1"]),
}
