"""Expert parallelism against plain PyTorch (#51): transformers MoE models from their default configs shrunk,
called with labels and ``output_router_logits=True``, wrapped with ``ep_size=2`` on 2 ranks, trained 3
AdamW steps beside a one-process reference on the same slices (each slice's loss, auxiliary loss included,
is its own, as under DDP: docs/design.md's contract); losses, whole gradients and parameters within the
design's tolerances. A skewed router (every token to the experts of EP rank 0, so rank 1's receive none)
still trains, and each rank holds only its own experts."""

from __future__ import annotations

import contextlib
import copy
import gc
import math

import torch
from dist_harness import raised, run_distributed
from parity import ADAMW_REL, LOSS_RTOL, SGD_TOL
from torch.distributed.device_mesh import init_device_mesh

import bmt_wrap as bmt
from bmt_wrap.job.distributed import parallel_layout
from bmt_wrap.runtime.sharded_tensor import ShardedTensor
from tests import models

STEPS, BATCH, SEQ = 3, 4, 8


def _whole(t: torch.Tensor, expert: bool) -> torch.Tensor:
    """A parameter or gradient read whole: an expert tensor's EP ranks' experts joined in rank order."""
    full = t.full_tensor() if isinstance(t, ShardedTensor) else t.detach()
    if not expert:
        return full
    ep = parallel_layout().ep
    out = torch.empty(ep.world_size * full.numel(), dtype=full.dtype)
    ep.all_gather_into(out, full.contiguous().view(-1), label="test: whole experts")
    return out.view(ep.world_size * full.shape[0], *full.shape[1:])


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, output_router_logits=True).loss


def _train(build, skew: bool = False, ep: int = 2, readers: str = "", mesh: object = None) -> dict:
    """Train a wrapped copy (``ep_size=ep``) and the sliced reference side by side; assert parity every step."""
    rank, n = bmt.rank(), bmt.world_size()
    ref = build()
    if skew:  # every token's top-2 are experts 0 and 1: both on EP rank 0
        with torch.no_grad():
            for layer in ref.model.layers:
                layer.mlp.router.bias[:2] = 100.0
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref), ep_size=ep, mesh=mesh)
    experts = set(model.plan.experts.expert_params())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(7)
    ref_params = dict(ref.named_parameters())
    losses, routed = [], []
    for _ in range(STEPS):
        ids = torch.randint(0, models.VOCAB, (BATCH, SEQ), generator=g)
        ref_loss = torch.stack([_loss(ref, s) for s in ids.chunk(n)])
        (ref_loss.mean()).backward()
        loss = _loss(model, ids.chunk(n)[rank])
        loss.backward()
        if readers:  # the norm of the whole gradient, every EP rank's experts counted once
            norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None])
            torch.testing.assert_close(model.clip_grad_norm_(1e9), norm, rtol=1e-5, atol=0)
        torch.testing.assert_close(loss.detach(), ref_loss[rank].detach(), rtol=LOSS_RTOL, atol=0)
        losses.append(float(loss))
        for name, p in model.named_parameters():
            want = ref_params[name].grad
            assert (p.grad is None) == (want is None), name
            if want is not None:
                torch.testing.assert_close(_whole(p.grad, name in experts), want, **SGD_TOL,
                                           msg=lambda m, name=name: f"grad {name}: {m}")
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
        for name, p in model.named_parameters():
            want = ref_params[name].detach()
            rel = float((_whole(p, name in experts) - want).norm() / want.norm().clamp_min(1e-12))
            assert rel <= ADAMW_REL, f"{name}: relative difference {rel:.2e}"
        routed.append(bmt.distributed.comm().snapshot().get("all_to_all", {}).get("calls", 0))
    if readers:
        _check_readers(model, ref, experts, readers)
    shapes = {n: list(p.shape) for n, p in model.named_parameters() if n in experts}
    held = {id(p.flat_buffer): p.flat_buffer.shard for n, p in model.named_parameters() if n in experts}
    return {"losses": losses, "expert_shapes": shapes, "plan": str(model.plan), "a2a_calls": routed,
            "expert_bytes": sum(s.numel() * s.element_size() for s in held.values())}


def _check_readers(model: torch.nn.Module, ref: torch.nn.Module, experts: set[str], tmp: str) -> None:
    """state_dict() and bmt.save hold whole expert tensors under their names, load_state_dict() and bmt.load
    take them back (sharded checkpoints: tests/test_checkpoint_experts.py)."""
    state = model.state_dict()
    params = dict(model.named_parameters())
    for name, value in state.items():
        if name in params:
            assert torch.equal(value, _whole(params[name], name in experts)), name
    model.load_state_dict(ref.state_dict())
    for name, p in model.named_parameters():
        assert torch.equal(_whole(p, name in experts), ref.get_parameter(name).detach()), name
    path = f"{tmp}/ep.safetensors"
    bmt.save(model, path)
    from safetensors.torch import load_file

    saved = load_file(path)
    assert set(saved) == set(ref.state_dict()) and all(torch.equal(saved[k], v) for k, v in ref.state_dict().items())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()
    bmt.load(model, path)
    for name, p in model.named_parameters():
        assert torch.equal(_whole(p, name in experts), ref.get_parameter(name).detach()), f"bmt.load {name}"


def _parity_body(tmp: str) -> dict:
    return {"mixtral": _train(models.mixtral, readers=tmp), "skewed": _train(models.gpt_oss, skew=True),
            **{name: _train(getattr(models, name)) for name in ("qwen3_moe", "qwen2_moe", "deepseek_v3")}}


def test_ep2_matches_plain_pytorch_on_transformers_moe_models_and_a_skewed_gpt_oss(tmp_path) -> None:
    # Mixtral, Qwen3-MoE, Qwen2-MoE (a gated shared expert), DeepSeek-V3 (shared experts, group routing)
    results = run_distributed(_parity_body, 2, str(tmp_path))  # each rank asserts parity at every step
    for got in results:
        mixtral = got["mixtral"]
        # Each rank holds 2 of each layer's 4 experts; the plan says which.
        assert all(s[0] == 2 for s in mixtral["expert_shapes"].values()) and mixtral["expert_shapes"]
        assert "ep rank 0: experts 0-1; ep rank 1: experts 2-3" in mixtral["plan"]
        for name in ("skewed", "qwen3_moe", "qwen2_moe", "deepseek_v3"):
            assert got[name]["expert_shapes"] and all(s[0] == 2 for s in got[name]["expert_shapes"].values())
    # The two ranks trained on different slices, and the skewed run's rank 1 received no token yet ran every
    # all-to-all its peer ran (the counts agree).
    assert results[0]["mixtral"]["losses"] != results[1]["mixtral"]["losses"]
    assert results[0]["skewed"]["a2a_calls"] == results[1]["skewed"]["a2a_calls"]


def _foreign_expert_bytes(ref: torch.nn.Module, layers: list, ep_rank: int) -> int:
    """Bytes of the experts EP rank ``ep_rank`` of 2 does not own whose values some live tensor outside ``ref``
    holds: each expert slab is looked for by its first 8 values in every live storage (read as fp32)."""
    skip = {p.untyped_storage().data_ptr() for p in ref.parameters()}
    slabs = [ref.get_parameter(name).detach()[e] for layer in layers for name in layer.params
             for e in range(layer.num_experts) if e not in layer.owned(ep_rank, 2)]
    smallest = min(slab.numel() * slab.element_size() for slab in slabs)
    storages = {}
    for t in gc.get_objects():
        if issubclass(type(t), torch.Tensor) and t.device.type == "cpu":
            try:
                s = t.untyped_storage()
                ptr = s.data_ptr()
            except (RuntimeError, NotImplementedError):  # a fake tensor torch.export left for gc: no memory
                continue
            if ptr not in skip and s.nbytes() >= smallest:  # a storage that can hold a whole expert
                storages[ptr] = s
    found = 0
    for slab in slabs:
        head = slab.reshape(-1)[:8]
        for s in storages.values():
            flat = torch.empty(0).set_(s, 0, (s.nbytes() // 4,))
            starts = (flat[:-7] == head[0]).nonzero().flatten().tolist()
            if any(torch.equal(flat[i:i + 8], head) for i in starts):
                found += slab.numel() * slab.element_size()
                break
    return found


def _forward_peak_of_foreign_experts(model: torch.nn.Module, layers: list, ids: torch.Tensor) -> int:
    """The most bytes of experts this rank does not own that live tensors hold at the end of any MoE layer's
    call during a forward of ``model`` (after its first): the block's gathered buffers and the one gathered
    ahead are live then, and the buffer pool keeps whatever a transient gather wrote."""
    ref, peak = models.mixtral(), [0]  # the experts' values as wrapped: built alike on every rank

    def probe(*_: object) -> None:
        peak[0] = max(peak[0], _foreign_expert_bytes(ref, layers, bmt.rank()))

    handles = [model.get_submodule(layer.module).register_forward_hook(probe) for layer in layers]
    with torch.no_grad():
        _loss(model, ids)
    for h in handles:
        h.remove()
    return peak[0]


def _errors_body() -> dict:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    wrapped = bmt.BMTrainModelWrapper(models.mixtral(), mesh=mesh)  # a mesh dim "ep" is ep_size=2
    layout = (parallel_layout().ep_size, wrapped.plan.experts.ep_size, parallel_layout().describe())
    # During a forward no live tensor holds the other EP rank's experts; in a dense ZeRO-3 job's (which
    # gathers every expert) the same probe finds them all.
    ids = torch.randint(0, models.VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(bmt.rank()))
    layers = wrapped.plan.experts.layers
    _loss(wrapped, ids)  # the first call captures
    foreign = {"ep2": _forward_peak_of_foreign_experts(wrapped, layers, ids)}
    del wrapped
    gc.collect()
    dense = bmt.BMTrainModelWrapper(models.mixtral())
    _loss(dense, ids)
    foreign["dense"] = _forward_peak_of_foreign_experts(dense, layers, ids)
    del dense
    gc.collect()
    return {
        "mesh": layout, "foreign": foreign,
        "other_experts": sum(math.prod(shape) * 4 // 2 for layer in layers for shape in layer.params.values()),
        "mesh_and_size": raised(lambda: bmt.BMTrainModelWrapper(models.mixtral(), mesh=mesh, ep_size=1)),
        "world": raised(lambda: bmt.BMTrainModelWrapper(models.mixtral(), ep_size=3)),
        "experts": raised(lambda: bmt.BMTrainModelWrapper(_three_experts(), ep_size=2)),
        "dense": raised(lambda: bmt.BMTrainModelWrapper(models.llama(), ep_size=2)),
    }


def _three_experts() -> torch.nn.Module:
    """Mixtral with 3 experts per layer: ep_size=2 cannot split them evenly."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return models.seeded(lambda: MixtralForCausalLM(MixtralConfig(**{**models._moe_small(), "num_local_experts": 3})))


def test_ep_errors_are_named_on_every_rank_and_no_rank_materialises_another_ranks_experts() -> None:
    for got in run_distributed(_errors_body, 2):
        assert got["mesh"] == (2, 2, "shard 2 (ep 2)")
        # the other EP rank's experts: none during the EP forward, all of them during the dense one's
        assert got["foreign"] == {"ep2": 0, "dense": got["other_experts"]}, got
        kind, text = got["mesh_and_size"]
        assert kind == "MeshError" and "ep_size=1 differs from the mesh's 'ep' dimension (2)" in text
        kind, text = got["world"]
        assert kind == "ExpertParallelError" and "ep_size=3 must be a positive int dividing the 2" in text
        kind, text = got["experts"]
        assert kind == "ExpertParallelError" and "does not divide the experts of model.layers.0.mlp (3)" in text
        kind, text = got["dense"]
        assert kind == "ExpertParallelError" and "no mixture-of-experts layer was found in LlamaForCausalLM" in text


def _four_ranks_body() -> dict:
    out = {}
    for ep in (2, 4):  # ep2 x dp2: each pair of owners shards its experts ZeRO-3; ep4: one expert per rank
        out[ep] = _train(models.mixtral, ep=ep)
    gc.collect()  # the models above go before one of another layout is wrapped
    # HSDP: two replicas of a 2-rank shard group, ep2 within each (expert gradients averaged across replicas)
    out["hsdp"] = _train(models.mixtral, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    return out


def test_ep2_by_dp2_ep4_and_hsdp_ep2_match_plain_pytorch_and_hold_their_share() -> None:
    model = models.mixtral()
    total = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    for got in run_distributed(_four_ranks_body, 4):
        for ep, run in got.items():
            assert all(s[0] == 4 // (2 if ep == "hsdp" else ep) for s in run["expert_shapes"].values())
            # this rank's expert shards: its experts split over the world / ep ranks owning them (HSDP: each
            # replica holds all experts, half on each of its two ranks)
            share = total / 2 if ep == "hsdp" else total / 4
            assert run["expert_bytes"] <= 1.05 * share, (ep, run["expert_bytes"], total)


def _composed_body() -> dict:
    """no_sync accumulation, fused_loss=True and generate() under ep_size=2, each against the reference."""
    rank, n = bmt.rank(), bmt.world_size()
    ref = models.mixtral()
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref), ep_size=2, fused_loss=True)
    experts = set(model.plan.experts.expert_params())
    g = torch.Generator().manual_seed(11)
    halves = [torch.randint(0, models.VOCAB, (n, SEQ), generator=g) for _ in range(2)]
    for i, ids in enumerate(halves):  # two micro-batches, the first without communication
        with model.no_sync() if i == 0 else contextlib.nullcontext():
            _loss(model, ids.chunk(n)[rank]).backward()
    sum(torch.stack([_loss(ref, s) for s in ids.chunk(n)]).mean() for ids in halves).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(_whole(p.grad, name in experts), ref.get_parameter(name).grad, **SGD_TOL,
                                   msg=lambda m, name=name: f"no_sync grad {name}: {m}")
    prompt = torch.randint(0, models.VOCAB, (1, 5), generator=torch.Generator().manual_seed(rank))
    settings = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    model.eval(), ref.eval()
    got, want = model.generate(prompt, **settings), ref.generate(prompt, **settings)
    section = model.plan.fused_loss
    return {"generated": got.tolist(), "want": want.tolist(),
            "fused": section.enabled and section.head is not None and section.reason is None}


def test_no_sync_fused_loss_and_generate_under_ep2() -> None:
    for got in run_distributed(_composed_body, 2):
        assert got["generated"] == got["want"] and got["fused"]


def _offload_body(tmp: str) -> dict:
    """offload="disk" and a memory budget under ep_size=2: gradients equal the in-memory EP job's, bit for bit."""
    rank, n = bmt.rank(), bmt.world_size()
    ids = torch.randint(0, models.VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(5)).chunk(n)[rank]
    grads = []
    for kw in ({}, {"offload": "disk", "offload_dir": tmp}, {"memory_budget": 64 << 20}):
        model = bmt.BMTrainModelWrapper(models.mixtral(), ep_size=2, **kw)
        experts = set(model.plan.experts.expert_params())
        _loss(model, ids).backward()
        grads.append({name: _whole(p.grad, name in experts) for name, p in model.named_parameters()})
        del model
        gc.collect()
    for other in grads[1:]:
        for name, g in grads[0].items():
            assert torch.equal(other[name], g), name
    return {"compared": len(grads[0])}


def test_offload_and_memory_budget_under_ep2(tmp_path) -> None:
    assert all(got["compared"] > 0 for got in run_distributed(_offload_body, 2, str(tmp_path)))
