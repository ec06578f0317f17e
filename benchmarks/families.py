"""transformers models from their default configs, sizes shrunk, grown by layers: the plan-against-
measurement benchmark's models (``benchmarks/plan_truth.py``). Nothing else is turned off: ``use_cache``,
dropout and every other default stay as a user gets them.

Each factory takes ``n_layers`` (the CLI's ``--grow n_layers``) and builds under whatever device the caller
set (the CLI builds on the meta device).
"""

from __future__ import annotations

from torch import nn

VOCAB, HIDDEN, FFN, HEADS = 8000, 384, 1024, 6
BATCH, SEQ = 4, 128  # per rank, called as users call a language model: input_ids and labels


def llama(n_layers: int = 4) -> nn.Module:
    """LlamaForCausalLM (untied head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                        num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                        num_hidden_layers=n_layers))


def gpt2(n_layers: int = 4) -> nn.Module:
    """GPT2LMHeadModel (tied head, Conv1D projections)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_head=HEADS, n_layer=n_layers,
                                      bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1))  # in the shrunk vocabulary


def qwen2(n_layers: int = 4) -> nn.Module:
    """Qwen2ForCausalLM with tied embeddings, as Qwen2's small checkpoints ship."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                        num_attention_heads=HEADS, num_key_value_heads=2,
                                        num_hidden_layers=n_layers, tie_word_embeddings=True))


def t5(n_layers: int = 4) -> nn.Module:
    """T5ForConditionalGeneration with ``n_layers`` encoder and decoder layers."""
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_ff=FFN, num_heads=HEADS,
                                               d_kv=HIDDEN // HEADS, num_layers=n_layers,
                                               decoder_start_token_id=0))  # as t5-small's config sets it


def llama_gqa(n_layers: int = 4) -> nn.Module:
    """LlamaForCausalLM of width 320 (not a multiple of 128): grouped-query attention (5 heads of 64, one
    key-value head) and tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=320, intermediate_size=864,
                                        num_attention_heads=5, num_key_value_heads=1, tie_word_embeddings=True,
                                        num_hidden_layers=n_layers))


def llama_32k(n_layers: int = 4) -> nn.Module:
    """LlamaForCausalLM of width 256 with Llama's own 32,000-word vocabulary (untied): a root group as large
    as a dozen layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=688, num_attention_heads=4,
                                        num_key_value_heads=4, num_hidden_layers=n_layers))


def mixtral(n_layers: int = 4) -> nn.Module:
    """MixtralForCausalLM of width 256: a mixture-of-experts block (8 experts, 2 per token) and grouped-query
    attention (4 heads, 2 key-value heads)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            num_hidden_layers=n_layers))


FAMILIES = {"llama": llama, "gpt2": gpt2, "qwen2": qwen2, "t5": t5, "llama_gqa": llama_gqa,
            "llama_32k": llama_32k, "mixtral": mixtral}
