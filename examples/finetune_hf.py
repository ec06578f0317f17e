"""Fine-tune a transformers model for sequence classification with one wrapper line, then load the result
back with plain transformers.

The model is built from a small BERT config (or loaded from ``--model-dir``, a local directory you
already have, with its tokenizer); the data is a deterministic, generated review-sentiment task (filler
words, sentiment words, and "not" flipping the next one), split into train and held-out sets. After
training, ``bmt.save`` writes ``model.safetensors`` with the original parameter names beside the
model's ``config.json``, and rank 0 reloads that directory with ``AutoModelForSequenceClassification
.from_pretrained`` and scores it again: the same accuracy, without bmt_wrap.

    torchrun --nproc_per_node=2 examples/finetune_hf.py [--epochs 3] [--model-dir path/to/bert] [--out-dir out/finetune_hf]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import bmt_wrap as bmt

POSITIVE = "good great excellent wonderful delightful superb enjoyable brilliant charming moving".split()
NEGATIVE = "bad awful terrible boring dull clumsy tedious weak annoying forgettable".split()
FILLER = ("the a this that film movie story plot acting cast scene ending music it was is felt seemed "
          "quite very rather really overall and but with for of to in on").split()
SPECIAL = ["[PAD]", "[CLS]", "[UNK]"]
#: texts, max length -> model inputs (``input_ids``, ``attention_mask``)
Tokenize = Callable[[list[str], int], dict[str, torch.Tensor]]


def make_dataset(n: int, seed: int) -> list[tuple[str, int]]:
    """``n`` (text, label) reviews: label 1 when positive words, after "not" flips, outnumber negative ones."""
    rng = random.Random(seed)
    data = []
    while len(data) < n:
        words, score = [rng.choice(FILLER) for _ in range(rng.randint(4, 9))], 0
        for _ in range(rng.choice([1, 1, 2, 3])):
            positive = rng.random() < 0.5
            negated = rng.random() < 0.25
            word = rng.choice(POSITIVE if positive else NEGATIVE)
            score += (1 if positive else -1) * (-1 if negated else 1)
            at = rng.randint(0, len(words))
            words[at:at] = ["not", word] if negated else [word]
        if score != 0:  # ties have no label
            data.append((" ".join(words), int(score > 0)))
    return data


class WordTokenizer:
    """Whitespace tokenizer over the task's fixed vocabulary (for models built from a config)."""

    def __init__(self) -> None:
        self.vocab = {w: i for i, w in enumerate(SPECIAL + sorted(set(POSITIVE + NEGATIVE + FILLER + ["not"])))}

    def __call__(self, texts: list[str], max_len: int) -> dict[str, torch.Tensor]:
        rows = [[1] + [self.vocab.get(w, 2) for w in t.split()][:max_len - 1] for t in texts]
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def load_model(args: argparse.Namespace) -> tuple[nn.Module, Tokenize]:
    """(model, tokenizer): from ``--model-dir`` if given, else a small BERT built from a config."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig

    if args.model_dir:
        tok = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
        model = AutoModelForSequenceClassification.from_pretrained(args.model_dir, num_labels=2, local_files_only=True)
        return model, lambda texts, max_len: tok(texts, padding=True, truncation=True, max_length=max_len,
                                                  return_tensors="pt")
    tok = WordTokenizer()
    cfg = BertConfig(vocab_size=len(tok.vocab), hidden_size=args.hidden, num_hidden_layers=args.layers,
                     num_attention_heads=4, intermediate_size=4 * args.hidden, max_position_embeddings=64,
                     num_labels=2, pad_token_id=0)
    return AutoModelForSequenceClassification.from_config(cfg), tok


@torch.no_grad()
def accuracy(model: nn.Module, tokenize: Tokenize, data: list[tuple[str, int]], batch: int, max_len: int) -> float:
    """Fraction correct over ``data`` (every process must call it with the same data length)."""
    model.eval()
    correct = 0
    for i in range(0, len(data), batch):
        texts, labels = zip(*data[i:i + batch], strict=True)
        logits = model(**tokenize(list(texts), max_len)).logits
        correct += int((logits.argmax(-1) == torch.tensor(labels)).sum())
    model.train()
    return correct / len(data)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; the defaults train in well under a minute on 2 CPU ranks."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="a local transformers model directory (with its tokenizer) to fine-tune")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--train-size", type=int, default=2000)
    p.add_argument("--eval-size", type=int, default=400)
    p.add_argument("--batch", type=int, default=16, help="examples per rank per step")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--max-len", type=int, default=32)
    p.add_argument("--out-dir", default="out/finetune_hf")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Fine-tune, evaluate on the held-out split, save, reload with plain transformers, evaluate again."""
    args = parse_args(argv)
    bmt.init_distributed(seed=0)
    rank, world = bmt.rank(), bmt.world_size()
    data = make_dataset(args.train_size + args.eval_size, seed=1234)
    train, held_out = data[:args.train_size], data[args.train_size:]
    model, tokenize = load_model(args)
    model = bmt.BMTrainModelWrapper(model)
    optimizer = bmt.optim.AdamOptimizer(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps = args.epochs * (len(train) // (args.batch * world))
    schedule = bmt.lr_scheduler.Linear(optimizer, start_lr=args.lr, warmup_iter=steps // 10, end_iter=steps)
    manager = bmt.optim.OptimManager()
    manager.add_optimizer(optimizer, schedule)
    order = torch.Generator().manual_seed(0)
    step = 0
    for epoch in range(args.epochs):
        perm = torch.randperm(len(train), generator=order).tolist()  # the same on every rank
        for i in range(0, len(perm) - args.batch * world + 1, args.batch * world):
            mine = perm[i + rank * args.batch:i + (rank + 1) * args.batch]
            texts, labels = zip(*(train[j] for j in mine), strict=True)
            loss = nn.functional.cross_entropy(model(**tokenize(list(texts), args.max_len)).logits, torch.tensor(labels))
            manager.zero_grad()
            manager.backward(loss)
            manager.clip_grad_norm(max_norm=1.0)
            manager.step()
            step += 1
            if step % 20 == 0:
                bmt.print_rank(f"epoch {epoch} step {step}/{steps} loss {float(bmt.sum_loss(loss)):.4f}")
    # Every rank scores its equal slice of the held-out set (forwards are collectives: same count everywhere).
    per_rank = len(held_out) // world
    mine = held_out[rank * per_rank:(rank + 1) * per_rank]
    acc = float(bmt.sum_loss(torch.tensor(accuracy(model, tokenize, mine, 64, args.max_len))))
    chance = max(sum(y for _, y in held_out), sum(1 - y for _, y in held_out)) / len(held_out)
    bmt.print_rank(f"held-out accuracy {acc:.3f} (majority class {chance:.3f})")

    out = Path(args.out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(out)
    bmt.save(model, out / "model.safetensors")  # a collective: full tensors, original names, on rank 0
    result = {"accuracy": acc, "majority": chance, "steps": step}
    if rank == 0:
        from transformers import AutoModelForSequenceClassification

        plain = AutoModelForSequenceClassification.from_pretrained(out, local_files_only=True)
        result["reloaded_accuracy"] = accuracy(plain, tokenize, held_out[:per_rank * world], 64, args.max_len)
        print(f"reloaded {out} with plain transformers: held-out accuracy {result['reloaded_accuracy']:.3f}")
        (out / "metrics.json").write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
