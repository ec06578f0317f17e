"""The examples' training text: bytes of real Python source, present wherever torch is installed."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def load_corpus(max_bytes: int) -> torch.Tensor:
    """The installed torch package's ``.py`` files as byte values (sorted, so every rank reads the same bytes)."""
    root = Path(torch.__file__).resolve().parent
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def batch_for_step(corpus: torch.Tensor, step: int, seed: int, global_batch: int, seq: int,
                   rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch of ``step``: a function of the step, so resuming replays nothing."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.numel() - seq - 1, (global_batch,), generator=g)
    mine = starts.chunk(world)[rank]
    windows = torch.stack([corpus[s:s + seq + 1] for s in mine.tolist()])
    return windows[:, :-1], windows[:, 1:]


def byte_windows(corpus: torch.Tensor, count: int, seq: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``count`` training rows of ``seq`` bytes (``input_ids`` and ``labels``, as transformers' causal LMs
    take them: the model shifts the labels itself), at fixed random offsets."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, corpus.numel() - seq, (count,), generator=g)
    return [{"input_ids": corpus[s:s + seq], "labels": corpus[s:s + seq]} for s in starts.tolist()]


def byte_llama(layers: int, dim: int) -> torch.nn.Module:
    """A transformers Llama over bytes (vocab 256) from its default config with the sizes shrunk."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=dim, intermediate_size=4 * dim,
                                        num_hidden_layers=layers, num_attention_heads=max(1, dim // 32),
                                        num_key_value_heads=max(1, dim // 64), max_position_embeddings=1024))


def lm_arguments(description: str, out_dir: str) -> argparse.ArgumentParser:
    """The options the byte-level Llama examples share: length of the run, model and batch sizes, output."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="rows per rank and step")
    parser.add_argument("--out-dir", default=out_dir)
    return parser
