"""Context parallelism (#52, first part): the cp axis of the rank layout, the load-balanced split of a sequence
and its labels, and attention over the whole sequence by Ulysses and by a ring, against torch's SDPA on the
whole sequence (outputs and q/k/v gradients; float64 to rounding, float32 within the design's tolerances)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_harness import raised, run_distributed
from parity import ADAMW_REL, LOSS_RTOL, SGD_TOL, compare_grads, compare_params, wholes
from torch.distributed.device_mesh import init_device_mesh

from bmt_wrap.base.cp_plan import (
    check_padding_mask,
    count_items,
    local_indices,
    reassemble,
    shift_labels,
    split_sequence,
)
from bmt_wrap.errors import ContextParallelError
from bmt_wrap.runtime.comm import Communicator, SingleProcessCommunicator
from bmt_wrap.runtime.context_parallel import context_parallel_attention, slice_loss
from tests import models

F64_TOL = 1e-10  # float64: the same sums in another order
F32_TOL = {"rtol": 1e-5, "atol": 1e-6}  # docs/design.md's elementwise tolerance


# ---- the split ---------------------------------------------------------------------------------------------------
def test_load_balanced_split_and_reassembly() -> None:
    assert local_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert local_indices(16, 4, 1).tolist() == [2, 3, 12, 13]
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    for cp in (1, 2, 3, 4, 6):
        parts = [split_sequence(x, cp, r) for r in range(cp)]
        assert all(p.shape == (2, 24 // cp, 3) for p in parts)
        assert torch.equal(reassemble(parts), x)
    with pytest.raises(ContextParallelError, match="does not divide into 2 x cp_size = 4 .*pad_to_multiple_of=4"):
        local_indices(10, 2, 0)


def test_the_split_under_sequence_parallelism_asks_for_the_multiple_both_cuts_need() -> None:
    """sequence_parallel=True cuts a CP rank's S/C tokens again over the T TP ranks: S must be a multiple of
    C x T as well as of 2C. At T = 4, C = 2 a 12-token sequence splits into 4 chunks but a rank's 6 tokens do
    not cut in 4; the message said to pad to a multiple of T, which 12 already is."""
    assert local_indices(8, 2, 0, sp_size=2).tolist() == [0, 1, 6, 7]  # T <= 2 needs nothing more than 2C
    assert local_indices(16, 2, 1, sp_size=4).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ContextParallelError, match=r"cuts again over tp_size=4 .*pad_to_multiple_of=8\)"):
        local_indices(12, 2, 0, sp_size=4)


def test_labels_shift_across_chunk_boundaries_and_the_mean_is_over_every_token() -> None:
    torch.manual_seed(0)
    labels = torch.randint(0, 11, (2, 8))
    labels[1, 5:] = -100  # padding
    logits = torch.randn(2, 8, 11, dtype=torch.float64)
    whole = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))  # transformers' shift
    shifted = shift_labels(labels)
    assert shifted[:, :-1].tolist() == labels[:, 1:].tolist() and (shifted[:, -1] == -100).all()
    n = count_items(shifted)
    assert n == 7 + 4
    cp = 2
    parts = [F.cross_entropy(split_sequence(logits, cp, r).reshape(-1, 11), split_sequence(shifted, cp, r).reshape(-1),
                             reduction="sum") for r in range(cp)]
    # rank 0 holds tokens 0,1,6,7: token 1's label is token 2, which rank 1 holds
    assert split_sequence(shifted, cp, 0)[0, 1] == labels[0, 2]
    torch.testing.assert_close(sum(parts) / n, whole, rtol=1e-12, atol=0)
    means = sum(p / (split_sequence(shifted, cp, r) != -100).sum() for r, p in enumerate(parts)) / cp
    assert abs(float(means - whole)) > 1e-3  # the mean of per-rank means is another number


def test_masks_context_parallelism_cannot_split_are_refused() -> None:
    assert check_padding_mask(torch.tensor([[1, 1, 0]])).dtype == torch.bool
    with pytest.raises(ContextParallelError, match="2-D \\[batch, seq\\] padding mask only"):
        check_padding_mask(torch.ones(1, 1, 4, 4))
    with pytest.raises(ContextParallelError, match="values other than 0 and 1"):
        check_padding_mask(torch.tensor([[1, 1, 2, 2]]))


# ---- attention -------------------------------------------------------------------------------------------------
def _case(comm: Communicator, method: str, *, dtype: torch.dtype = torch.float64, batch: int = 2, heads: int = 4,
          kv_heads: int = 4, seq: int = 16, dim: int = 8, causal: bool = True, mask: str = "none",
          window: int | None = None, seed: int = 0) -> dict[str, float]:
    """This rank's part of CP attention against SDPA on the whole sequence: the largest absolute error of the
    output and of each gradient, and the largest reference value (for relative checks)."""
    cp, rank = comm.world_size, comm.rank
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, dim, generator=g, dtype=dtype)
    k = torch.randn(batch, kv_heads, seq, dim, generator=g, dtype=dtype)
    v = torch.randn(batch, kv_heads, seq, dim, generator=g, dtype=dtype)
    grad = torch.randn(batch, heads, seq, dim, generator=g, dtype=dtype)
    keys = torch.ones(batch, seq, dtype=torch.bool)
    if mask == "random":  # key 0 stays: every query sees a key
        keys = torch.rand(batch, seq, generator=g) < 0.7
        keys[:, 0] = True
    elif mask == "left":  # left padding: the padded queries see no key at all (zeros, as SDPA gives)
        keys[0, :5] = False
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    allowed = keys[:, None, None, :] & (torch.ones(seq, seq, dtype=torch.bool).tril() if causal else True)
    if window is not None:  # transformers' sliding_window_overlay: kv_idx > q_idx - window
        allowed = allowed & torch.ones(seq, seq, dtype=torch.bool).triu(1 - window)
    ref = F.scaled_dot_product_attention(*whole, attn_mask=allowed, enable_gqa=heads != kv_heads)
    ref.backward(grad)
    local = [split_sequence(t, cp, rank, dim=2).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, comm, token_index=local_indices(seq, cp, rank),
                                     key_mask=split_sequence(keys, cp, rank), causal=causal, window=window,
                                     method=method)
    out.backward(split_sequence(grad, cp, rank, dim=2))
    errors = {"out": (out - split_sequence(ref, cp, rank, dim=2)).abs().max().item()}
    for name, mine, theirs in zip("qkv", local, whole, strict=True):
        errors[f"d{name}"] = (mine.grad - split_sequence(theirs.grad, cp, rank, dim=2)).abs().max().item()
    errors["scale"] = max(ref.abs().max().item(), *(t.grad.abs().max().item() for t in whole))
    return errors


def _largest_tensor(comm: Communicator, mask: str, seq: int = 64) -> int:
    """The most elements any op makes in this rank's Ulysses attention, forward and backward, at ``seq`` tokens
    (4 heads of 2 dims: q, k and v hold ``8 x seq`` elements, a whole-sequence mask ``seq x seq``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    largest = [0]

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    largest[0] = max(largest[0], t.numel())
            return out

    cp, rank = comm.world_size, comm.rank
    g = torch.Generator().manual_seed(0)
    q, k, v = (split_sequence(torch.randn(1, 4, seq, 2, generator=g), cp, rank, dim=2).requires_grad_()
               for _ in range(3))
    keys = torch.ones(1, seq, dtype=torch.bool)
    keys[0, -3:] = mask != "right"
    with Sizes():
        out = context_parallel_attention(q, k, v, comm, token_index=local_indices(seq, cp, rank),
                                         key_mask=split_sequence(keys, cp, rank), method="ulysses")
        out.sum().backward()
    return largest[0]


def _within(errors: dict[str, float], tol: float) -> bool:
    return all(v <= tol for name, v in errors.items() if name != "scale")


@pytest.mark.parametrize("method", ["ulysses", "ring"])
def test_one_rank_attention_is_sdpas(method: str) -> None:
    comm = SingleProcessCommunicator()
    for kwargs in ({}, {"kv_heads": 2, "mask": "random"}, {"causal": False, "mask": "left"}, {"window": 5}):
        errors = _case(comm, method, **kwargs)
        assert _within(errors, F64_TOL), (kwargs, errors)


def _loss_case(comm: Communicator) -> tuple[float, float]:
    """This rank's ``slice_loss`` against the whole sequence's mean cross-entropy: the loss's error, and the
    error of this rank's logits' gradient divided by C (what ZeRO's average over a group holding the CP peers
    makes of a parameter's C-times parts: their sum) against the whole gradient's slice."""
    cp, rank = comm.world_size, comm.rank
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 16, 11, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 11, (2, 16), generator=g)
    labels[1, 9:] = -100
    whole = logits.clone().requires_grad_()
    ref = F.cross_entropy(whole[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
    ref.backward()
    shifted = shift_labels(labels)
    local = split_sequence(logits, cp, rank).requires_grad_()
    part = F.cross_entropy(local.reshape(-1, 11), split_sequence(shifted, cp, rank).reshape(-1), reduction="sum")
    loss = slice_loss(part / count_items(shifted), comm)
    loss.backward()
    return abs(loss.item() - ref.item()), (local.grad / cp - split_sequence(whole.grad, cp, rank)).abs().max().item()


#: (method, keyword arguments) checked at every CP size.
CASES = [(m, kw) for m in ("ulysses", "ring") for kw in (
    {},
    {"causal": False},
    {"mask": "random"},
    {"mask": "left"},
    {"kv_heads": 2},  # GQA
    {"heads": 5, "kv_heads": 5},  # heads not divisible by the CP size
    {"heads": 6, "kv_heads": 3},  # GQA groups not divisible by the CP size
    {"heads": 6, "kv_heads": 1, "mask": "random"},  # fewer KV heads than CP ranks
    {"window": 5, "kv_heads": 2, "mask": "random"},  # a sliding window (Mistral's) across chunk boundaries
)]


def _attention_body(cp_size: int) -> dict:
    import bmt_wrap as bmt
    from bmt_wrap.job.distributed import build_layout, job_layout

    mesh = job_layout(cp_size=cp_size)
    layout = build_layout(mesh)
    comm = layout.cp
    world = mesh.world
    device_mesh = init_device_mesh("cpu", (world // cp_size, cp_size), mesh_dim_names=("dp", "cp")) \
        if world > cp_size else init_device_mesh("cpu", (cp_size,), mesh_dim_names=("cp",))
    found = {"cp": (layout.cp_size, layout.cp_rank, comm.world_size), "data_parallel_size": mesh.data_parallel_size,
             "dp_rank": mesh.data_parallel_rank(layout.rank), "mesh": job_layout(device_mesh) == mesh,
             "mismatch": raised(lambda: job_layout(device_mesh, cp_size=1)),
             "bad_size": raised(lambda: job_layout(cp_size=3)),
             "wrap": raised(lambda: bmt.BMTrainModelWrapper(torch.nn.Linear(2, 2), cp_size=cp_size)),
             "method": raised(lambda: bmt.BMTrainModelWrapper(_long(), cp_size=cp_size, cp_method="zigzag")),
             "with_pp": raised(lambda: bmt.BMTrainModelWrapper(_long(), cp_size=2, pp_size=2)) if world == 4 else None}
    found["f64"] = [(m, kw, _case(comm, m, **kw)) for m, kw in CASES]
    found["f32"] = [(m, kw, _case(comm, m, dtype=torch.float32, **kw)) for m, kw in CASES[:1] + CASES[len(CASES) // 2:len(CASES) // 2 + 1]]
    found["loss"] = _loss_case(comm)
    found["too_few_heads"] = raised(lambda: _case(comm, "ulysses", heads=1, kv_heads=1))
    found["largest"] = {mask: _largest_tensor(comm, mask) for mask in ("none", "right")}
    return found


def _check_attention(results: list[dict], cp_size: int, world: int) -> None:
    for rank, got in enumerate(results):
        assert got["cp"] == (cp_size, rank % cp_size, cp_size)
        assert got["data_parallel_size"] == world // cp_size and got["dp_rank"] == rank // cp_size
        assert got["mesh"], "a DeviceMesh dim named 'cp' is the layout cp_size= builds"
        assert got["mismatch"][0] == "MeshError" and "cp_size=" in got["mismatch"][1], got["mismatch"]
        assert got["bad_size"][0] == "InitError" and "cp_size=3" in got["bad_size"][1], got["bad_size"]
        assert got["wrap"][0] == "UnsupportedError" and "transformers models" in got["wrap"][1], got["wrap"]
        assert got["method"][0] == "ContextParallelError" and "'zigzag'" in got["method"][1], got["method"]
        if world == 4:
            assert got["with_pp"][0] == "UnsupportedError" and "beside pp 2" in got["with_pp"][1], got["with_pp"]
        for method, kwargs, errors in got["f64"]:
            assert _within(errors, F64_TOL), (rank, method, kwargs, errors)
        for method, kwargs, errors in got["f32"]:
            tol = F32_TOL["atol"] + F32_TOL["rtol"] * errors["scale"]
            assert _within(errors, tol), (rank, method, kwargs, errors)
        assert max(got["loss"]) <= F64_TOL, got["loss"]
        kind, message = got["too_few_heads"]
        assert kind == "ContextParallelError" and "cp_method='ring'" in message, got["too_few_heads"]
        # Ulysses without padding: SDPA's is_causal, no [batch, 1, S, S] mask (CPU SDPA makes it a float bias
        # too); with padding the mask is built (the f64/f32 cases above compare both with torch's SDPA)
        assert got["largest"]["none"] < 64 * 64 <= got["largest"]["right"], got["largest"]


def test_attention_over_two_cp_ranks_is_the_whole_sequences() -> None:
    _check_attention(run_distributed(_attention_body, 2, 2), 2, 2)


def test_attention_over_four_cp_ranks_and_cp2_beside_dp2() -> None:
    _check_attention(run_distributed(_attention_body, 4, 4), 4, 4)
    _check_attention(run_distributed(_attention_body, 4, 2), 2, 4)


# ---- the one-liner -------------------------------------------------------------------------------------------
def _long(kind: str = "llama") -> torch.nn.Module:
    """A transformers causal LM from its default config shrunk, for sequences up to 1024: Llama, Qwen2 (GQA,
    q/k/v biases) or Mistral with a 48-token sliding window."""
    import transformers

    config = {**models._hf_small(), "max_position_embeddings": 1024}
    if kind == "mistral":
        config["sliding_window"] = 48
    name = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[kind]
    config_class, model_class = (getattr(transformers, f"{name}{s}") for s in ("Config", "ForCausalLM"))
    return models.seeded(lambda: model_class(config_class(**config)))


def _grad_norm_differences(ref: torch.nn.Module, model: torch.nn.Module, what: str) -> list[str]:
    """Gradients whose per-tensor relative difference from the reference's is above the AdamW tolerance."""
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    want = dict(ref.named_parameters())
    out = []
    for (name, _), grad in zip(named, wholes([(p.grad, p) for _, p in named]), strict=True):
        rel = float((grad - want[name].grad).norm() / want[name].grad.norm().clamp_min(1e-12))
        if rel > ADAMW_REL:
            out.append(f"{what} grad {name}: relative difference {rel:.2e} > {ADAMW_REL}")
    return out


def test_the_split_call_at_one_rank_is_the_models_own() -> None:
    """The hooks and the registered attention on one CP rank (no split): loss and gradients are the model's."""
    from bmt_wrap.wrapping.context_parallel import apply_context_parallel

    ref, model = _long(), _long()
    note = apply_context_parallel(model, SingleProcessCommunicator(), "ring")
    assert "model.layers.0.self_attn" in note and "(ring)" in note
    ids = torch.randint(0, models.VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, 25:] = 0
    batch = {"attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    losses = [m(ids, **batch).loss for m in (ref, model)]  # input_ids positional, as users call it
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=LOSS_RTOL, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **SGD_TOL, msg=lambda m, name=name: f"{name}: {m}")


def _cp_body(kind: str, method: str, seq: int, tp: int = 1, fused: bool = False, replicas: bool = False,
             sp: bool = False) -> dict:
    """A model wrapped with cp_size=2 (and ``tp_size=tp``, ``sequence_parallel=sp``; ``replicas``: HSDP, a
    (replicate, cp) mesh) beside
    the unwrapped one on the whole sequence, 3 AdamW steps with labels (the first without padding, so Ulysses
    runs SDPA's is_causal; then right padding); every check's failures, the losses, the first step's gradients
    and the final parameters read whole, and the plan's text. With more data-parallel slices than 1, each
    slice's loss is its own and the reference's gradient is the slices' average (DDP's)."""
    import bmt_wrap as bmt

    ref = _long(kind)
    mesh = init_device_mesh("cpu", (bmt.world_size() // 2, 2), mesh_dim_names=("replicate", "cp")) if replicas \
        else None
    model = bmt.BMTrainModelWrapper(_long(kind), cp_size=2, cp_method=method, tp_size=tp, fused_loss=fused,
                                    mesh=mesh, **({"sequence_parallel": True} if sp else {}))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model)]
    norm_tokens: set[int] = set()  # the tokens a block's first norm runs on in training calls
    model.get_submodule("model.layers.0.input_layernorm").register_forward_pre_hook(
        lambda m, args: norm_tokens.add(args[0].shape[1]) if torch.is_grad_enabled() else None)
    g = torch.Generator().manual_seed(3)
    failures: list[str] = []
    whole = None  # a fused loss's first call must carry labels: it is the capture that finds the loss
    with torch.no_grad():  # without gradients nothing is split: every rank runs the whole sequence
        ids = torch.randint(0, models.VOCAB, (1, 22), generator=g)  # 22 does not divide into 4 chunks
        if not fused:
            whole = (ref(input_ids=ids).logits - model(input_ids=ids).logits).abs().max().item()
    losses = []
    slices, mine = bmt.data_parallel_size(), bmt.data_parallel_rank()
    for step in range(3):
        ids = torch.randint(0, models.VOCAB, (2 * slices, seq), generator=g)
        mask = torch.ones(2 * slices, seq, dtype=torch.long)
        mask[1::2, seq - 37:] = int(step == 0)
        labels = ids.masked_fill(mask == 0, -100)
        batches = [{"input_ids": i, "attention_mask": m, "labels": la}
                   for i, m, la in zip(ids.chunk(slices), mask.chunk(slices), labels.chunk(slices), strict=True)]
        ref_losses = torch.stack([ref(**b).loss for b in batches])
        ref_losses.mean().backward()
        out = model(**batches[mine])
        assert not fused or out.logits is None  # the fused loss took them: never whole
        pair = [ref_losses[mine], out.loss]
        pair[1].backward()
        losses.append((pair[0].item(), pair[1].item()))
        if step == 0:  # the same parameters: elementwise
            compare_grads(ref, model, f"step {step}", failures)
            named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
            grads = dict(zip([n for n, _ in named], wholes([(p.grad, p) for _, p in named]), strict=True))
        else:  # AdamW turned rounding noise on near-zero gradients into lr-sized steps: relative norms
            failures += _grad_norm_differences(ref, model, f"step {step}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    compare_params(ref, model, "adamw", "after 3 steps", failures=failures)
    named = list(model.named_parameters())
    params = dict(zip([n for n, _ in named], wholes([(p, p) for _, p in named]), strict=True))
    cp_ops = {op: n["calls"] for op, n in bmt.comm_stats(by_group=True).get("cp", {}).items()}
    ids = ids[:1, :6]
    tp_section = model.plan.tensor_parallel
    split = sorted({e.module.rsplit(".", 1)[-1] for e in tp_section.entries}) if tp_section else []
    return {"failures": failures, "losses": losses, "plan": str(model.plan), "no_grad": whole, "cp_ops": cp_ops,
            "tp_split": split, "grads": grads, "params": params, "norm_tokens": norm_tokens,
            "odd": raised(lambda: model(input_ids=ids, labels=ids)),
            "differ": raised(lambda: model(input_ids=ids[:, :4] + bmt.rank(), labels=ids[:, :4]))}


def _check_cp2(got: dict, method: str, fused: bool = False) -> None:
    assert not got["failures"], got["failures"][:5]
    for ref, mine in got["losses"]:
        assert abs(ref - mine) <= LOSS_RTOL * abs(ref), got["losses"]
    assert f"context parallelism over 2 ranks ({method})" in got["plan"], got["plan"]
    assert fused or got["no_grad"] <= 1e-5, got["no_grad"]
    # attention met across the ranks: 2 layers x 3 steps x (forward + recompute + backward) at least
    assert got["cp_ops"].get("all_to_all", 0) >= 2 * 3 * 3 and got["cp_ops"].get("all_reduce", 0) >= 3, got
    assert got["odd"][0] == "ContextParallelError" and "2 x cp_size = 4" in got["odd"][1], got["odd"]
    assert got["differ"][0] == "ContextParallelError" and "DistributedSampler" in got["differ"][1], got["differ"]


# Each model kind at 2 ranks; Llama by both methods in the next test. fused_loss=True: the chunked loss on
# each rank's local tokens, with the labels shifted on the whole sequence.
@pytest.mark.parametrize("kind, method, seq, fused", [("qwen2", "ulysses", 512, False), ("mistral", "ring", 512, False),
                                                      ("llama", "ring", 256, True)])
def test_cp2_trains_as_on_the_whole_sequence(kind: str, method: str, seq: int, fused: bool) -> None:
    for got in run_distributed(_cp_body, 2, kind, method, seq, fused=fused):
        _check_cp2(got, method, fused)


def test_ring_and_ulysses_train_llama_alike_at_1024_tokens() -> None:
    """Both methods against the whole sequence and against each other: the first step's gradients elementwise,
    the losses and the parameters after 3 AdamW steps within the design's tolerances."""
    for ulysses, ring in run_distributed(_runs_body, 2, [("llama", "ulysses", {}), ("llama", "ring", {})], 1024):
        _check_cp2(ulysses, "ulysses")
        _check_cp2(ring, "ring")
        for (_, a), (_, b) in zip(ulysses["losses"], ring["losses"], strict=True):
            assert abs(a - b) <= LOSS_RTOL * abs(a), (ulysses["losses"], ring["losses"])
        for name, grad in ulysses["grads"].items():
            torch.testing.assert_close(ring["grads"][name], grad, **SGD_TOL, msg=lambda m, n=name: f"grad {n}: {m}")
        for name, value in ulysses["params"].items():
            rel = float((ring["params"][name] - value).norm() / value.norm().clamp_min(1e-12))
            assert rel <= ADAMW_REL, f"{name}: ring and Ulysses differ by {rel:.2e} > {ADAMW_REL}"


def test_cp2_beside_dp2_trains_as_ddp_on_whole_sequences() -> None:
    """4 ranks: ZeRO-3 over the two data-parallel slices and the two CP ranks of each."""
    results = run_distributed(_cp_body, 4, "llama", "ring", 512)
    for got in results:
        assert not got["failures"], got["failures"][:5]
        for ref, mine in got["losses"]:
            assert abs(ref - mine) <= LOSS_RTOL * abs(ref), got["losses"]
    assert results[0]["losses"] != results[2]["losses"]  # the slices are different data


def _runs_body(runs: list[tuple[str, str, dict]], seq: int) -> list[dict]:
    """``_cp_body`` for each (model kind, method, keyword arguments), on one worker group."""
    import gc

    out = []
    for kind, method, kwargs in runs:
        gc.collect()  # the models above go before one of another layout is wrapped
        out.append(_cp_body(kind, method, seq, **kwargs))
    return out


def test_cp2_beside_tp2_and_beside_replicas_trains_as_on_the_whole_sequence() -> None:
    """4 ranks: TP splits each layer's heads over 2 ranks, and CP's attention runs on each TP rank's heads (2
    query heads, 1 KV head: Ulysses over 2 CP ranks repeats K/V to the query heads); Qwen2's fused loss is
    vocabulary-parallel (its head split by TP) on each CP rank's tokens. Then HSDP: 2 replicas of a cp2 pair
    (each replica its own data slice, gradients averaged across the replicas). Llama runs with TP's
    sequence_parallel=True: between the blocks' TP regions each CP rank's 128 tokens are split again, 64 to
    a TP rank, gathered whole for the attention's heads (the attention's path is TP's without it, which
    Qwen2's ring run takes: one run covers both, each run costs seconds)."""
    runs = [("llama", "ulysses", {"tp": 2, "sp": True}), ("qwen2", "ring", {"tp": 2, "fused": True}),
            ("llama", "ring", {"replicas": True})]
    results = run_distributed(_runs_body, 4, runs, 256)
    assert results[0][2]["losses"] != results[2][2]["losses"]  # HSDP: the replicas take different slices
    for got in results:
        for (kind, method, kwargs), one in zip(runs, got, strict=True):
            assert not one["failures"], (kind, one["failures"][:5])
            for ref, mine in one["losses"]:
                assert abs(ref - mine) <= LOSS_RTOL * abs(ref), (kind, one["losses"])
            assert f"context parallelism over 2 ranks ({method})" in one["plan"], one["plan"]
            assert one["cp_ops"].get("all_to_all", 0) >= 2 * 3 * 3, one["cp_ops"]
            assert one["norm_tokens"] == {256 // (4 if kwargs.get("sp") else 2)}, (kwargs, one["norm_tokens"])
            assert one["differ"][0] == "ContextParallelError", one["differ"]
            if kwargs.get("tp"):
                assert {"q_proj", "k_proj", "v_proj", "o_proj", "down_proj"} <= set(one["tp_split"]), one["tp_split"]
