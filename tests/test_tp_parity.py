"""Explicit tensor-parallel API against plain PyTorch (issue 28): a toy GPT built from BMTrain's layers in
BMTrain's layout (activations split by sequence between the parallel linears, ``VPEmbedding`` lookup and
tied projection, ``FusedCrossEntropy(parallel=True)``) trains like the same model unsharded, at
tp2 x dp2, tp4 x dp1 and tp1 x dp4 on 4 ranks: losses per step, the global gradient norm, whole
gradients and final parameters within the Contracts' SGD tolerances; and with BMTrain's step
(``AdamOptimizer``, ``OptimManager.clip_grad_norm``) against torch's AdamW within the AdamW tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_harness import COMM_TIMEOUT, run_distributed
from parity import ADAMW_REL, LOSS_RTOL, SGD_TOL
from torch import nn

import bmt_wrap as bmt
from bmt_wrap.job.tp_values import whole_value

V, D, HEADS, FF, S, LAYERS, BATCH, STEPS = 64, 32, 4, 64, 8, 2, 4, 3


# ---- the plain model --------------------------------------------------------------------------------------------
class RefAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (S, B, D)
        return self.o(_attend(self.q(h), self.k(h), self.v(h), HEADS))


class RefBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = RefAttention()
        self.ff_in, self.ff_out = nn.Linear(D, FF), nn.Linear(FF, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln1(h))
        return h + self.ff_out(torch.relu(self.ff_in(self.ln2(h))))


class RefGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(S, D) * 0.1)
        self.blocks = nn.ModuleList(RefBlock() for _ in range(LAYERS))
        self.lnf = nn.LayerNorm(D)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = (self.emb(tokens) + self.pos).transpose(0, 1)  # sequence first, as the TP model
        for block in self.blocks:
            h = block(h)
        logits = F.linear(self.lnf(h).transpose(0, 1), self.emb.weight)
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Causal attention over (S, B, heads * hd) projections; returns (S, B, heads * hd)."""
    seq, batch, width = q.shape
    q, k, v = (t.reshape(seq, batch, heads, width // heads).permute(1, 2, 0, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.permute(2, 0, 1, 3).reshape(seq, batch, width)


# ---- the same model from BMTrain's tensor-parallel layers --------------------------------------------------------
class Layernorm(bmt.DistributedModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = bmt.DistributedParameter(torch.ones(D))
        self.bias = bmt.DistributedParameter(torch.zeros(D))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(h, (D,), self.weight, self.bias)


class TPAttention(bmt.DistributedModule):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (bmt.nn.ColumnParallelLinear(D, D, gather_input=True) for _ in range(3))
        self.o = bmt.nn.RowParallelLinear(D, D)  # reduce-scatter: back to this rank's part of the sequence

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (S / T, B, D) -> (S / T, B, D)
        return self.o(_attend(self.q(h), self.k(h), self.v(h), HEADS // bmt.config["tp_size"]))


class TPBlock(bmt.DistributedModule):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = Layernorm(), Layernorm()
        self.attn = TPAttention()
        self.ff_in = bmt.nn.ColumnParallelLinear(D, FF, gather_input=True)
        self.ff_out = bmt.nn.RowParallelLinear(FF, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln1(h))
        return h + self.ff_out(torch.relu(self.ff_in(self.ln2(h))))


class TPGPT(bmt.DistributedModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = bmt.nn.VPEmbedding(V, D, dtype=torch.float32)
        self.pos = bmt.DistributedParameter(torch.zeros(S, D))
        self.blocks = bmt.TransformerBlockList([bmt.Block(TPBlock()) for _ in range(LAYERS)])
        self.lnf = Layernorm()
        self.loss = bmt.loss.FusedCrossEntropy(parallel=True)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        tp, r = bmt.config["tp_size"], bmt.config["tp_rank"]
        bmt.check_tp_inputs_agree([tokens, targets], "the batch")
        part = slice(r * S // tp, (r + 1) * S // tp)  # this TP rank's part of the sequence
        h = (self.emb(tokens[:, part]) + self.pos[part]).transpose(0, 1).contiguous()
        h = self.blocks(h)
        logits = self.emb(self.lnf(h).transpose(0, 1), projection=True)  # (B, S, V / T)
        return self.loss(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---- side by side --------------------------------------------------------------------------------------------------
def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        seq = torch.randint(0, V, (BATCH, S + 1), generator=g)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def _whole_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: whole_value(p, p.grad.full_tensor()) for n, p in model.named_parameters()}


def _parity_body(tp_size: int) -> dict:
    bmt.init_distributed(seed=0, backend="gloo", timeout=COMM_TIMEOUT, tp_size=tp_size)
    torch.manual_seed(0)
    ref = RefGPT()
    model = TPGPT()
    model.load_state_dict(ref.state_dict())  # whole tensors in, each rank keeps its slices
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp, dp_rank = bmt.config["tp_zero_size"], bmt.config["tp_zero_rank"]
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    worst = {"loss": 0.0, "grad": 0.0}
    for tokens, targets in _batches():
        ref_loss = ref(tokens, targets)
        ref_loss.backward()
        loss = model(tokens[rows], targets[rows])
        loss.backward()
        global_loss = bmt.sum_loss(loss)  # the dp average (TP peers hold the same loss)
        torch.testing.assert_close(global_loss, ref_loss.detach(), rtol=LOSS_RTOL, atol=0)
        got = _whole_grads(model)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got[name], p.grad, **SGD_TOL, msg=lambda m, n=name: f"grad of {n}: {m}")
            worst["grad"] = max(worst["grad"], float((got[name] - p.grad).abs().max()))
        worst["loss"] = max(worst["loss"], abs(float(global_loss) - float(ref_loss)))
        # The global norm counts TP slices once each and whole parameters once per TP group.
        norm = bmt.optim.clip_grad_norm_(model.parameters(), max_norm=1e9)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=1e9)
        torch.testing.assert_close(norm.float(), ref_norm, rtol=LOSS_RTOL, atol=0)
        torch_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)  # torch's own, too
        torch.testing.assert_close(torch_norm.float(), ref_norm, rtol=LOSS_RTOL, atol=0)
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    state = model.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), **SGD_TOL, msg=lambda m, n=name: f"param {n}: {m}")
    return worst


@pytest.mark.parametrize("tp_size", [2, 4, 1], ids=["tp2xdp2", "tp4xdp1", "tp1xdp4"])
def test_explicit_tp_gpt_trains_like_plain_pytorch(tp_size: int) -> None:
    run_distributed(_parity_body, 4, tp_size)


def _adam_body(tp_size: int) -> dict:
    """BMTrain's training step (AdamOptimizer, OptimManager with clipping) under TP against torch's AdamW
    with ``clip_grad_norm_`` on the plain model: losses per step and the AdamW parameter tolerance."""
    bmt.init_distributed(seed=0, backend="gloo", timeout=COMM_TIMEOUT, tp_size=tp_size)
    torch.manual_seed(0)
    ref = RefGPT()
    model = TPGPT()
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    opt = bmt.optim.AdamOptimizer(model.parameters(), lr=1e-2, weight_decay=0.01)
    manager = bmt.optim.OptimManager()
    manager.add_optimizer(opt)
    dp, dp_rank = bmt.config["tp_zero_size"], bmt.config["tp_zero_rank"]
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    for tokens, targets in _batches():
        ref_loss = ref(tokens, targets)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        manager.zero_grad()
        loss = model(tokens[rows], targets[rows])
        manager.backward(loss)
        norm = manager.clip_grad_norm(max_norm=0.5)
        manager.step()
        torch.testing.assert_close(bmt.sum_loss(loss), ref_loss.detach(), rtol=LOSS_RTOL, atol=0)
        torch.testing.assert_close(norm.float(), ref_norm, rtol=LOSS_RTOL, atol=0)
    state = model.state_dict()
    worst = 0.0
    for name, p in ref.named_parameters():
        rel = float((state[name] - p.detach()).norm() / p.detach().norm().clamp_min(1e-12))
        assert rel <= ADAMW_REL, (name, rel)
        worst = max(worst, rel)
    return {"worst_rel": worst}


def test_explicit_tp_gpt_with_bmtrains_optimizer_and_clipping_matches_adamw() -> None:
    run_distributed(_adam_body, 4, 2)
