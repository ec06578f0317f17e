"""BMTrain's GPT example on bmt_wrap's explicit API: migrating is `import bmtrain as bmt` -> `import bmt_wrap as bmt`.

The layers, the model and the training loop follow BMTrain's ``example/`` (layers/, models/gpt.py,
train.py) line for line: ``DistributedModule`` layers owning ``DistributedParameter``s, each transformer
layer a ``CheckpointBlock`` in a ``TransformerBlockList``, ``init_parameters``, ``AdamOffloadOptimizer``,
a Noam schedule and ``OptimManager``. BMTrain's example trains on random tokens; this one reads the
bytes of torch's Python sources as ``train_gpt.py`` does (so the loss visibly falls), keeping the
example's random sequence lengths and padding masks. Defaults are small enough for 2 CPU ranks:

    torchrun --nproc_per_node=2 examples/bmtrain_style.py [--steps 60] [--save model.safetensors]

``--tp-size 2`` is BMTrain's ``init_distributed(tp_size=2)``: as in BMTrain's example, each TP rank
holds its part of the sequence between the parallel layers (``ColumnParallelLinear`` gathers it,
``RowParallelLinear`` reduce-scatters back), the word embedding is a ``VPEmbedding`` (lookup and tied
projection) and the loss ``FusedCrossEntropy(parallel=True)``. BMTrain's parallel linears gather dim 0,
so the layers run sequence-first there (BMTrain views its gathered (tp*batch, seq/tp) rows as
(batch, seq), which mixes sequences once batch > 1):

    torchrun --nproc_per_node=4 examples/bmtrain_style.py --tp-size 2
"""

from __future__ import annotations

import argparse
import functools
import math
import time

import torch
import torch.nn.functional as F
from corpus import batch_for_step, load_corpus  # train_gpt.py's corpus (examples/ is on sys.path when run)

import bmt_wrap as bmt


# ---- layers (BMTrain: example/layers/) ----------------------------------------------------------
class Linear(bmt.DistributedModule):
    """``y = x W^T + b`` with sharded ``weight`` (out x in) and ``bias``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = bmt.DistributedParameter(torch.empty(out_features, in_features, dtype=dtype),
                                               init_method=torch.nn.init.xavier_normal_)
        self.bias = bmt.DistributedParameter(torch.empty(out_features, dtype=dtype), init_method=torch.nn.init.zeros_) \
            if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(bmt.DistributedModule):
    """Token lookup; ``projection=True`` multiplies by the transposed table (a tied LM head)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        # std 0.02 rather than BMTrain's 1.0: with the tied head, unit-variance embeddings start at loss ~60.
        self.weight = bmt.DistributedParameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype),
                                               init_method=functools.partial(torch.nn.init.normal_, std=0.02))

    def forward(self, x: torch.Tensor, projection: bool = False) -> torch.Tensor:
        return F.linear(x, self.weight) if projection else F.embedding(x, self.weight)


class Layernorm(bmt.DistributedModule):
    """Layer normalisation over the last dimension with sharded ``weight`` and ``bias``."""

    def __init__(self, dim_norm: int, dtype: torch.dtype | None = None, eps: float = 1e-5):
        super().__init__()
        self.eps, self.dim_norm = eps, dim_norm
        self.weight = bmt.DistributedParameter(torch.empty(dim_norm, dtype=dtype), init_method=torch.nn.init.ones_)
        self.bias = bmt.DistributedParameter(torch.empty(dim_norm, dtype=dtype), init_method=torch.nn.init.zeros_)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.dim_norm,), self.weight, self.bias, self.eps)


def sequence_first(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer`` on ``x`` (batch, seq, dim) run sequence-first: BMTrain's parallel linears gather and scatter
    dim 0, which must then be the sequence (identity cost without tensor parallelism is not paid: only
    the TP path calls this)."""
    return layer(x.transpose(0, 1).contiguous()).transpose(0, 1)


class Attention(bmt.DistributedModule):
    """Multi-head attention with a boolean mask (True = may attend); under TP, this rank's heads."""

    def __init__(self, dim_model: int, dim_head: int, num_heads: int, bias: bool = True,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp = bmt.config["tp_size"] > 1
        if self.tp:
            # Each rank's heads over the whole (gathered) sequence; the output reduce-scattered back.
            self.project_q = bmt.nn.ColumnParallelLinear(dim_model, dim_head * num_heads, bias=bias, dtype=dtype)
            self.project_k = bmt.nn.ColumnParallelLinear(dim_model, dim_head * num_heads, bias=bias, dtype=dtype)
            self.project_v = bmt.nn.ColumnParallelLinear(dim_model, dim_head * num_heads, bias=bias, dtype=dtype)
            self.project_out = bmt.nn.RowParallelLinear(dim_head * num_heads, dim_model, bias=bias, dtype=dtype)
        else:
            self.project_q = Linear(dim_model, dim_head * num_heads, bias=bias, dtype=dtype)
            self.project_k = Linear(dim_model, dim_head * num_heads, bias=bias, dtype=dtype)
            self.project_v = Linear(dim_model, dim_head * num_heads, bias=bias, dtype=dtype)
            self.project_out = Linear(dim_head * num_heads, dim_model, bias=bias, dtype=dtype)
        self.num_heads, self.dim_head = num_heads // bmt.config["tp_size"], dim_head

    def forward(self, hidden_q: torch.Tensor, hidden_kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.tp:
            q, k, v = (sequence_first(f, hidden_q) for f in (self.project_q, self.project_k, self.project_v))
            return sequence_first(self.project_out, self._attend(q, k, v, mask))
        return self.project_out(self._attend(self.project_q(hidden_q), self.project_k(hidden_kv),
                                             self.project_v(hidden_kv), mask))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, sq, _ = q.shape
        skv = k.shape[1]
        q = q.view(b, sq, self.num_heads, self.dim_head).transpose(1, 2)
        k = k.view(b, skv, self.num_heads, self.dim_head).transpose(1, 2)
        v = v.view(b, skv, self.num_heads, self.dim_head).transpose(1, 2)
        score = (q @ k.transpose(-1, -2)) / math.sqrt(self.dim_head)
        blocked = ~mask.unsqueeze(1)
        # Padding rows see no key at all: their all -inf softmax is NaN, so zero them after it (as BMTrain does).
        score = score.masked_fill(blocked, float("-inf")).softmax(dim=-1).masked_fill(blocked, 0)
        return (score @ v).transpose(1, 2).reshape(b, sq, self.num_heads * self.dim_head)


class Feedforward(bmt.DistributedModule):
    """Two linear layers with a ReLU between."""

    def __init__(self, dim_model: int, dim_ff: int, bias: bool = True,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp = bmt.config["tp_size"] > 1
        if self.tp:
            self.w_in = bmt.nn.ColumnParallelLinear(dim_model, dim_ff, bias=bias, dtype=dtype)
            self.w_out = bmt.nn.RowParallelLinear(dim_ff, dim_model, bias=bias, dtype=dtype)
        else:
            self.w_in = Linear(dim_model, dim_ff, bias=bias, dtype=dtype)
            self.w_out = Linear(dim_ff, dim_model, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp:
            return sequence_first(lambda h: self.w_out(F.relu(self.w_in(h))), x)
        return self.w_out(F.relu(self.w_in(x)))


class TransformerEncoder(bmt.DistributedModule):
    """Pre-norm attention and feed-forward, each with a residual connection."""

    def __init__(self, dim_model: int, dim_head: int, num_heads: int, dim_ff: int, bias: bool = True,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.ln_attn = Layernorm(dim_model, dtype=dtype)
        self.attn = Attention(dim_model, dim_head, num_heads, bias=bias, dtype=dtype)
        self.ln_ff = Layernorm(dim_model, dtype=dtype)
        self.ff = Feedforward(dim_model, dim_ff, bias=bias, dtype=dtype)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.ln_attn(hidden)
        hidden = hidden + self.attn(x, x, mask)
        return hidden + self.ff(self.ln_ff(hidden))


# ---- model (BMTrain: example/models/gpt.py) -----------------------------------------------------
class GPT(bmt.DistributedModule):
    """Word + position embeddings, checkpointed encoder layers, final norm, LM head tied to the embedding."""

    def __init__(self, num_layers: int, vocab_size: int, dim_model: int, dim_head: int, num_heads: int,
                 dim_ff: int, max_distance: int, bias: bool = True, dtype: torch.dtype | None = None):
        super().__init__()
        self.max_distance = max_distance
        if bmt.config["tp_size"] > 1:
            self.word_emb = bmt.nn.VPEmbedding(vocab_size, dim_model, dtype=dtype, init_std=0.02)
        else:
            self.word_emb = Embedding(vocab_size, dim_model, dtype=dtype)
        self.pos_emb = Embedding(max_distance, dim_model, dtype=dtype)
        self.transformers = bmt.TransformerBlockList([
            bmt.CheckpointBlock(TransformerEncoder(dim_model, dim_head, num_heads, dim_ff, bias, dtype))
            for _ in range(num_layers)])
        self.layernorm = Layernorm(dim_model, dtype=dtype)

    def forward(self, input: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        mask_2d = mask[:, None, :] & mask[:, :, None]
        mask_2d = mask_2d & (pos[:, None, :] <= pos[:, :, None])  # causal
        if bmt.config["tp_size"] > 1:  # this rank's part of the sequence (BMTrain's example)
            input = input.chunk(bmt.config["tp_size"], dim=1)[bmt.config["tp_rank"]]
            pos = pos.chunk(bmt.config["tp_size"], dim=1)[bmt.config["tp_rank"]]
        out = self.pos_emb(pos) + self.word_emb(input)
        out = self.transformers(out, mask_2d)
        return self.word_emb(self.layernorm(out), projection=True)


# ---- training (BMTrain: example/train.py) -------------------------------------------------------
def get_batch(corpus: torch.Tensor, step: int, batch: int, seq: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This data-parallel rank's byte windows for ``step`` (TP peers share them), each cut to a random
    length; targets -100 past each length."""
    # BMTrain's example: the data-parallel size and rank are tp_zero_size / tp_zero_rank under TP.
    world, rank = bmt.config["tp_zero_size"], bmt.config["tp_zero_rank"]
    enc_input, targets = batch_for_step(corpus, step, 0, batch * world, seq, rank, world)
    gen = torch.Generator().manual_seed(step * world + rank)
    length = torch.randint(seq // 2, seq + 1, (batch,), generator=gen)
    mask = torch.arange(seq)[None, :] < length[:, None]
    targets = torch.where(mask, targets, torch.full_like(targets, -100))
    return enc_input.to(device), targets.to(device), length.to(device)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (the defaults train in seconds on 2 CPU ranks)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-2, help="Noam's start_lr (peaks near start_lr / sqrt(warmup))")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save", help="write the consolidated model here with bmt.save at the end")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size (BMTrain's tp_size)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[float]:
    """Train; return the global loss of every step."""
    args = parse_args(argv)
    bmt.init_distributed(seed=0, tp_size=args.tp_size)
    device = bmt.get_state().device
    half = device.type == "cuda"  # BMTrain's example trains in fp16 with loss scaling on GPU
    dtype = torch.half if half else torch.float32
    with torch.device(device):  # BMTrain's layers allocate on "cuda"; these on the job's device
        model = GPT(num_layers=args.layers, vocab_size=256, dim_model=args.dim,
                    dim_head=args.dim // args.heads, num_heads=args.heads, dim_ff=4 * args.dim,
                    max_distance=args.seq, bias=True, dtype=dtype)
    bmt.init_parameters(model)
    bmt.see_memory("model sharded")
    if bmt.config["tp_size"] > 1:  # vocabulary-split logits
        loss_func = bmt.loss.FusedCrossEntropy(ignore_index=-100, parallel=True)
    else:
        loss_func = torch.nn.CrossEntropyLoss(ignore_index=-100)
    optimizer = bmt.optim.AdamOffloadOptimizer(model.parameters(), lr=args.lr, weight_decay=1e-2)
    lr_scheduler = bmt.lr_scheduler.Noam(optimizer, start_lr=args.lr, warmup_iter=10, end_iter=args.steps)
    optim_manager = bmt.optim.OptimManager(loss_scale=2**20 if half else None)
    optim_manager.add_optimizer(optimizer, lr_scheduler)
    bmt.synchronize()

    corpus = load_corpus(4 * 2**20)
    losses = []
    for iteration in range(args.steps):
        st = time.time()
        enc_input, targets, length = get_batch(corpus, iteration, args.batch, args.seq, device)
        pos = torch.arange(args.seq, device=device).repeat(args.batch, 1)
        logits = model(enc_input, pos, pos < length[:, None])
        loss = loss_func(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        global_loss = bmt.sum_loss(loss).item()
        optim_manager.zero_grad()
        optim_manager.backward(loss)
        grad_norm = optim_manager.clip_grad_norm(optimizer.param_groups, max_norm=1.0)
        optim_manager.step()
        losses.append(global_loss)
        if iteration % args.log_every == 0 or iteration == args.steps - 1:
            bmt.print_rank(f"| Iter: {iteration:4d} | loss: {global_loss:.4f} | lr: {lr_scheduler.current_lr:.4e} "
                           f"| scale: {optim_manager.loss_scale:g} | grad_norm: {float(grad_norm):.3f} "
                           f"| time: {time.time() - st:.3f} |")
    bmt.print_rank(bmt.inspect.format_summary(bmt.inspect.inspect_model(model, "*layernorm*")))
    if args.save:
        bmt.save(model, args.save)
        bmt.print_rank(f"saved {args.save}")
    return losses


if __name__ == "__main__":
    main()
