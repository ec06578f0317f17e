"""Expert parallelism against plain PyTorch (#51): transformers MoE models from their default configs shrunk,
called with labels and ``output_router_logits=True``, wrapped with ``ep_size=2`` on 2 ranks, trained 3
AdamW steps beside a one-process reference on the same slices (each slice's loss, auxiliary loss included,
is its own, as under DDP: docs/design.md's contract); losses, whole gradients and parameters within the
design's tolerances. A skewed router (every token to the experts of EP rank 0, so rank 1's receive none;
at ep4 every token to one expert, so three ranks receive none) still trains, and each rank holds only its own experts. Also: experts held in a
ModuleList (trained with torch.optim.Muon), ep2 x dp2, ep4, HSDP and ep2 with tp2 at 4 ranks."""

from __future__ import annotations

import contextlib
import copy
import gc
import math

import torch
from dist_harness import raised, run_distributed
from parity import ADAMW_REL, LOSS_RTOL, SGD_TOL, wholes
from torch.distributed.device_mesh import init_device_mesh

import bmt_wrap as bmt
from bmt_wrap.job.distributed import parallel_layout
from tests import models

STEPS, BATCH, SEQ = 3, 4, 8
# The families every 4-rank layout runs: packed experts, DeepSeek-V3's beside shared experts, gpt-oss's with
# biases; one layer each (DeepSeek-V3's is then its MoE layer), Mixtral's two (one MoE block prefetched while
# another runs), to keep each layout's runs short.
FAMILIES = {"mixtral": models.mixtral, "qwen3_moe": lambda: models.qwen3_moe(num_hidden_layers=1),
            "deepseek_v3": lambda: models.deepseek_v3(num_hidden_layers=1),
            "gpt_oss": lambda: models.gpt_oss(num_hidden_layers=1)}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Every ``.grad`` as a user reads it: ``full_tensor()`` (a collective; ``parity.wholes`` runs one per
    shard group), a TP-split one joined over its TP peers; a packed expert parameter's is its EP rank's
    experts, as its ``p.shape`` says."""
    named = [(name, p) for name, p in model.named_parameters() if p.grad is not None]
    grads: dict[str, torch.Tensor | None] = {name: None for name, _ in model.named_parameters()}
    grads.update(zip((n for n, _ in named), wholes([(p.grad, p) for _, p in named]), strict=True))
    return grads


def _same_experts(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """``want`` (the reference's whole tensor) cut to what ``got`` holds: a packed expert parameter's EP rank's
    experts (dim 0, EP ranks in order), else all of it."""
    if got.shape == want.shape:
        return want
    layout = bmt.parallel_layout()
    return want.chunk(layout.ep_size)[layout.ep_rank]


def _check_grads(model: torch.nn.Module, ref: torch.nn.Module, what: str, first: bool = True) -> None:
    """Every gradient of ``model`` (read as a user reads it) is the reference's, None where the reference's is:
    elementwise on the ``first`` step (the same parameters: SGD's tolerance), then within AdamW's per-tensor
    relative norm, as its parameters are (Adam turns fp32 noise on near-zero gradients into lr-sized steps,
    and the next gradients follow them: docs/design.md's tolerances)."""
    for name, got in _grads(model).items():
        want = ref.get_parameter(name).grad
        assert (got is None) == (want is None), f"{what} {name}"
        if want is None:
            continue
        want = _same_experts(got, want)
        if first:
            torch.testing.assert_close(got, want, **SGD_TOL, msg=lambda m, name=name: f"{what} grad {name}: {m}")
        else:
            rel = float((got - want).norm() / want.norm().clamp_min(1e-12))
            assert rel <= ADAMW_REL, f"{what} grad {name}: relative difference {rel:.2e}"


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, output_router_logits=True).loss


def _adamw(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)]


def _muon(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """torch's Muon on the blocks' matrices (routers, each expert's Linears), AdamW on the rest."""
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("layers.")]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and n.startswith("layers."))]
    return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1), torch.optim.AdamW(rest, lr=1e-3)]


def _drop_beyond_capacity(ref: torch.nn.Module, factor: float) -> list[int]:
    """Make ``ref`` (plain PyTorch) apply ``ep_capacity_factor=factor``'s rule: in each call of a layer's
    experts, expert e takes the first ceil(factor x tokens x k / experts) (token, expert) pairs routed to it,
    in token order, and a dropped pair's combine weight is zero. Returns a counter of the pairs dropped."""
    dropped = [0]
    for layer in ref.model.layers:
        experts, num = layer.mlp.experts, ref.config.num_local_experts

        def capped(hidden, idx, weights, forward=experts.forward, num=num):
            tokens, k = idx.shape
            cap, taken, keep = math.ceil(factor * tokens * k / num), [0] * num, torch.ones_like(weights)
            for t in range(tokens):
                for j in range(k):
                    e = int(idx[t, j])
                    if taken[e] == cap:
                        keep[t, j] = 0
                        dropped[0] += 1
                    else:
                        taken[e] += 1
            return forward(hidden, idx, weights * keep)

        experts.forward = capped
    return dropped


def _train(build, skew: bool = False, ep: int = 2, readers: str = "", mesh: object = None, tp: int | None = None,
           loss=_loss, optims=_adamw, capacity: float | None = None) -> dict:
    """Train a wrapped copy (``ep_size=ep``, ``tp_size=tp``, ``ep_capacity_factor=capacity``) and the sliced
    reference (dropping as that factor says) side by side with ``optims``; assert parity every step."""
    ref = build()
    if skew:  # every token's top-k are experts 0 .. k-1 (top-2: EP rank 0's at ep2; top-1: expert 0 alone)
        with torch.no_grad():
            for layer in ref.model.layers:
                layer.mlp.router.bias[:ref.config.num_experts_per_tok] = 100.0
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref), ep_size=ep, mesh=mesh, tp_size=tp,
                                    ep_capacity_factor=capacity)
    dropped = _drop_beyond_capacity(ref, capacity) if capacity is not None else [0]  # after the copy: ref's own
    rank, n = bmt.data_parallel_rank(), bmt.data_parallel_size()  # TP peers take the same slice
    experts = tuple(f"{layer.experts}." for layer in model.plan.experts.layers)
    ref_opts, opts = optims(ref), optims(model)
    g = torch.Generator().manual_seed(7)
    losses, routed = [], []
    for _ in range(STEPS):
        ids = torch.randint(0, models.VOCAB, (BATCH, SEQ), generator=g)
        ref_loss = torch.stack([loss(ref, s) for s in ids.chunk(n)])
        (ref_loss.mean()).backward()
        got = loss(model, ids.chunk(n)[rank])
        got.backward()
        if readers:  # the norm of the whole gradient, every EP rank's experts counted once
            norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None])
            torch.testing.assert_close(model.clip_grad_norm_(1e9), norm, rtol=1e-5, atol=0)
        torch.testing.assert_close(got.detach(), ref_loss[rank].detach(), rtol=LOSS_RTOL, atol=0)
        losses.append(float(got))
        _check_grads(model, ref, f"step {len(losses)}", first=len(losses) == 1)
        for o in ref_opts + opts:
            o.step()
            o.zero_grad()
        routed.append(bmt.distributed.comm().snapshot().get("all_to_all", {}).get("calls", 0))
    # The parameters after the steps, whole as state_dict() holds them (every EP rank's experts under their names)
    state = model.state_dict()
    for name, want in ref.named_parameters():
        rel = float((state[name] - want.detach()).norm() / want.detach().norm().clamp_min(1e-12))
        assert rel <= ADAMW_REL, f"{name}: relative difference {rel:.2e}"
    if readers:
        _check_readers(model, ref, readers)
    # an EP rank's experts: packed ones' (its experts on dim 0) or its own of a ModuleList, and the part of
    # them this rank holds (to_local: its range of each)
    mine = [(n, p) for n, p in model.named_parameters() if n.startswith(experts)]
    q = dict(model.named_parameters()).get("model.layers.0.self_attn.q_proj.weight")
    total = sum(p.numel() * p.element_size() for name, p in ref.named_parameters() if name.startswith(experts))
    return {"losses": losses, "expert_shapes": {n: list(p.shape) for n, p in mine}, "plan": str(model.plan), "ep": ep,
            "dropped": dropped[0],
            "a2a_calls": routed, "total": total, "q_shape": list(q.shape) if q is not None else None,
            "expert_bytes": sum(p.to_local().numel() * p.element_size() for _, p in mine)}


def _check_readers(model: torch.nn.Module, ref: torch.nn.Module, tmp: str) -> None:
    """state_dict() and bmt.save hold whole expert tensors under their names, load_state_dict() and bmt.load
    take them back (sharded checkpoints: tests/test_checkpoint_experts.py)."""
    assert list(model.state_dict()) == list(ref.state_dict())  # every expert (a list's: every EP rank's), in order
    model.load_state_dict(ref.state_dict())
    again = model.state_dict()  # other EP ranks' experts too, gathered from their owners
    assert all(torch.equal(again[k], v) for k, v in ref.state_dict().items())
    path = f"{tmp}/ep.safetensors"
    bmt.save(model, path)
    from safetensors.torch import load_file

    saved = load_file(path)
    assert set(saved) == set(ref.state_dict()) and all(torch.equal(saved[k], v) for k, v in ref.state_dict().items())
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert all(not v.any() for v in model.state_dict().values())
    bmt.load(model, path)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in ref.state_dict().items()), "bmt.load"


def _parity_body(tmp: str) -> dict:
    # experts in a ModuleList (each rank keeps its slice), trained with torch's Muon on their matrices
    listed = _train(models.list_moe, loss=lambda m, ids: m(ids, ids), optims=_muon, readers=tmp)
    listed["refused"] = raised(lambda: bmt.init_parameters(bmt.BMTrainModelWrapper(models.list_moe(), ep_size=2)))
    # a capacity factor: each expert takes at most ceil(0.75 x 16 tokens x 2 / 4) = 6 of a rank's 32 pairs
    capped = _train(models.mixtral, capacity=0.75)
    return {"mixtral": _train(models.mixtral, readers=tmp), "skewed": _train(models.gpt_oss, skew=True), "list": listed,
            "capped": capped,
            **{name: _train(getattr(models, name)) for name in ("qwen3_moe", "qwen2_moe", "deepseek_v3")}}


def test_ep2_matches_plain_pytorch_on_transformers_moe_models_a_skewed_gpt_oss_and_listed_experts(tmp_path) -> None:
    # Mixtral, Qwen3-MoE, Qwen2-MoE (a gated shared expert), DeepSeek-V3 (shared experts, group routing), and
    # experts held in a ModuleList trained with torch.optim.Muon
    results = run_distributed(_parity_body, 2, str(tmp_path))  # each rank asserts parity at every step
    for rank, got in enumerate(results):
        # a ModuleList's experts: rank r keeps experts 2r and 2r+1 under their own names; the whole-state readers
        # hold and take every expert (_check_readers); init_parameters refuses them by name
        held = {name.split(".experts.")[1].split(".")[0] for name in got["list"]["expert_shapes"]}
        assert held == {str(2 * rank), str(2 * rank + 1)}, held
        assert got["list"]["expert_bytes"] <= 1.05 * got["list"]["total"] / 2
        kind, text = got["list"]["refused"]
        assert kind == "UnsupportedError" and "init_parameters of experts held as a ModuleList" in text
        mixtral = got["mixtral"]
        # Each rank holds 2 of each layer's 4 experts; the plan says which.
        assert all(s[0] == 2 for s in mixtral["expert_shapes"].values()) and mixtral["expert_shapes"]
        assert "ep rank 0: experts 0-1; ep rank 1: experts 2-3" in mixtral["plan"]
        # ep_capacity_factor=0.75 dropped pairs (the reference dropped the same ones: the losses and gradients
        # matched it at every step) and the plan says so
        assert got["capped"]["dropped"] > 0 and "capacity factor 0.75" in got["capped"]["plan"]
        for name in ("skewed", "qwen3_moe", "qwen2_moe", "deepseek_v3"):
            assert got[name]["expert_shapes"] and all(s[0] == 2 for s in got[name]["expert_shapes"].values())
    # The two ranks trained on different slices, and the skewed run's rank 1 received no token yet ran every
    # all-to-all its peer ran (the counts agree).
    assert results[0]["mixtral"]["losses"] != results[1]["mixtral"]["losses"]
    assert results[0]["skewed"]["a2a_calls"] == results[1]["skewed"]["a2a_calls"]


def _live_storages() -> set[int]:
    """Where the live CPU tensors' storages sit (after a collection): what an earlier test body left behind."""
    gc.collect()
    ptrs = set()
    for t in gc.get_objects():
        if issubclass(type(t), torch.Tensor) and t.device.type == "cpu":
            try:
                ptrs.add(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # a fake tensor torch.export left for gc: no memory
                continue
    return ptrs


def _foreign_expert_bytes(ref: torch.nn.Module, layers: list, ep_rank: int, before: set[int]) -> int:
    """Bytes of the experts EP rank ``ep_rank`` of 2 does not own whose values some live tensor outside ``ref``
    holds, of the storages not in ``before``: each expert slab is looked for by its first 8 values in every
    live storage (read as fp32)."""
    skip = {p.untyped_storage().data_ptr() for p in ref.parameters()} | before
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


def _forward_peak_of_foreign_experts(model: torch.nn.Module, layers: list, ids: torch.Tensor,
                                     before: set[int]) -> int:
    """The most bytes of experts this rank does not own that live tensors hold at the end of any MoE layer's
    call during a forward of ``model`` (after its first), of the storages not in ``before`` (alive before
    the model was built): the block's gathered buffers and the one gathered ahead are live then, and the
    buffer pool keeps whatever a transient gather wrote."""
    ref, peak = models.mixtral(), [0]  # the experts' values as wrapped: built alike on every rank

    def probe(*_: object) -> None:
        peak[0] = max(peak[0], _foreign_expert_bytes(ref, layers, bmt.rank(), before))

    handles = [model.get_submodule(layer.module).register_forward_hook(probe) for layer in layers]
    with torch.no_grad():
        _loss(model, ids)
    for h in handles:
        h.remove()
    return peak[0]


def _errors_body() -> dict:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    # A model an earlier body of this worker left for the collector holds the same seeded experts: only
    # storages made from here on count (seen in a full run, where the probe found half of them).
    before = _live_storages()
    wrapped = bmt.BMTrainModelWrapper(models.mixtral(), mesh=mesh)  # a mesh dim "ep" is ep_size=2
    layout = (parallel_layout().ep_size, wrapped.plan.experts.ep_size, parallel_layout().describe())
    # During a forward no live tensor holds the other EP rank's experts; in a dense ZeRO-3 job's (which
    # gathers every expert) the same probe finds them all.
    ids = torch.randint(0, models.VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(bmt.rank()))
    layers = wrapped.plan.experts.layers
    _loss(wrapped, ids)  # the first call captures
    foreign = {"ep2": _forward_peak_of_foreign_experts(wrapped, layers, ids, before)}
    del wrapped
    gc.collect()
    dense = bmt.BMTrainModelWrapper(models.mixtral())
    _loss(dense, ids)
    foreign["dense"] = _forward_peak_of_foreign_experts(dense, layers, ids, before)
    del dense
    gc.collect()
    return {
        "mesh": layout, "foreign": foreign,
        "other_experts": sum(math.prod(shape) * 4 // 2 for layer in layers for shape in layer.params.values()),
        "mesh_and_size": raised(lambda: bmt.BMTrainModelWrapper(models.mixtral(), mesh=mesh, ep_size=1)),
        "world": raised(lambda: bmt.BMTrainModelWrapper(models.mixtral(), ep_size=3)),
        "experts": raised(lambda: bmt.BMTrainModelWrapper(_three_experts(), ep_size=2)),
        "dense": raised(lambda: bmt.BMTrainModelWrapper(models.llama(), ep_size=2)),
        "dict": raised(lambda: bmt.BMTrainModelWrapper(_dict_experts(), ep_size=2)),
        "capacity_alone": raised(lambda: bmt.BMTrainModelWrapper(models.mixtral(), ep_capacity_factor=1.0)),
        "capacity_zero": raised(lambda: bmt.BMTrainModelWrapper(models.mixtral(), ep_size=2, ep_capacity_factor=0)),
    }


class _DictExperts(torch.nn.ModuleDict):
    """A ModuleDict of experts, called as a list's are: its keys are names, so nothing numbers an EP rank's."""

    def __init__(self, dim: int, num: int) -> None:
        super().__init__({f"e{i}": torch.nn.Linear(dim, dim) for i in range(num)})

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.values()):
            rows, slot = torch.where(idx == e)
            out = out.index_add(0, rows, expert(x[rows]) * weights[rows, slot, None])
        return out


def _dict_experts() -> torch.nn.Module:
    moe = models.ListMoE(8)
    moe.experts = _DictExperts(8, 4)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), moe)


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
        # 3 experts, 2 ranks: no size fits both (it once suggested 3, which the 2 ranks refuse)
        assert "No ep_size > 1 divides every layer's experts and the 2 ranks" in text and "[3]" not in text
        kind, text = got["dict"]
        assert kind == "ExpertParallelError" and "1.experts holds its experts in a ModuleDict" in text
        kind, text = got["dense"]
        assert kind == "ExpertParallelError" and "no mixture-of-experts layer was found in LlamaForCausalLM" in text
        kind, text = got["capacity_alone"]
        assert kind == "ExpertParallelError" and "ep_capacity_factor=1.0 caps what each expert takes under " \
                                                 "expert parallelism: give ep_size=" in text
        kind, text = got["capacity_zero"]
        assert kind == "ExpertParallelError" and "ep_capacity_factor must be a positive number" in text


def _dp_and_ep4_body() -> dict:
    out = {}
    for name, build in FAMILIES.items():  # ep2 x dp2: each pair of owners shards its experts ZeRO-3
        out[f"ep2 x dp2 {name}"] = _train(build)
        gc.collect()  # the models above go before one of another layout is wrapped
    for name in ("mixtral", "qwen3_moe", "deepseek_v3"):  # ep4: one expert per rank
        out[f"ep4 {name}"] = _train(FAMILIES[name], ep=4)
        gc.collect()
    # ep4, top-1 gpt-oss with every token routed to expert 0: ranks 1-3 receive none
    out["ep4 skewed gpt_oss"] = _train(lambda: models.gpt_oss(top_k=1), skew=True, ep=4)
    return out


def _hsdp_and_tp_body() -> dict:
    # HSDP: two replicas of a 2-rank shard group, ep2 within each (expert gradients averaged across replicas)
    out = {"hsdp": _train(models.mixtral, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))}
    gc.collect()
    # ep2 with tp2: attention split over TP peers, each TP rank's tokens routed within its own EP group; the
    # experts' owners (TP peers among them) shard them ZeRO-3. Qwen3-MoE's plan splits the embedding and head,
    # not attention.
    for name, build in FAMILIES.items():
        out[f"ep2 x tp2 {name}"] = _train(build, tp=2)
        gc.collect()
    split = {"layers.*.moe.experts.*.0": "colwise", "layers.*.moe.experts.*.2": "rowwise"}
    refused = raised(lambda: bmt.BMTrainModelWrapper(models.list_moe(), ep_size=2, tp_size=2, tp_plan=split))
    return {**out, "split_experts": refused}


def _check_shares(results: list[dict]) -> None:
    """Each rank's expert shards: its experts split over the world / ep ranks owning them (HSDP: each
    replica holds all experts, half on each of its two ranks)."""
    for got in results:
        for what, run in got.items():
            assert run["expert_shapes"] and all(s[0] == 4 // run["ep"] for s in run["expert_shapes"].values()), what
            share = run["total"] / 2 if what == "hsdp" else run["total"] / 4
            assert run["expert_bytes"] <= 1.05 * share, (what, run["expert_bytes"], run["total"])


# Two calls on the same 4-rank worker group (no second start-up), each well inside the harness's time-out.
def test_ep2_by_dp2_and_ep4_on_every_family_match_plain_pytorch_and_hold_their_share() -> None:
    results = run_distributed(_dp_and_ep4_body, 4)
    every = {f"{layout} {name}" for layout in ("ep2 x dp2", "ep4") for name in FAMILIES}
    assert set(results[0]) == (every - {"ep4 gpt_oss"}) | {"ep4 skewed gpt_oss"}
    _check_shares(results)
    # the skewed ep4 run's idle ranks ran every all-to-all the busy one ran
    assert len({tuple(got["ep4 skewed gpt_oss"]["a2a_calls"]) for got in results}) == 1


def test_hsdp_ep2_and_ep2_with_tp2_on_every_family_match_plain_pytorch_and_hold_their_share() -> None:
    results = run_distributed(_hsdp_and_tp_body, 4)
    for got in results:  # a tp_plan splitting expert weights is refused on every rank, naming one
        kind, text = got.pop("split_experts")
        assert kind == "ExpertParallelError" and "splits expert weight layers.0.moe.experts.0.0.bias" in text
    _check_shares(results)
    assert all(got["ep2 x tp2 mixtral"]["q_shape"] == [16, 32] for got in results)  # attention split over TP


def _composed_body() -> dict:
    """no_sync accumulation, fused_loss=True and generate() under ep_size=2, each against the reference."""
    rank, n = bmt.rank(), bmt.world_size()
    ref = models.mixtral()
    model = bmt.BMTrainModelWrapper(copy.deepcopy(ref), ep_size=2, fused_loss=True)
    g = torch.Generator().manual_seed(11)
    halves = [torch.randint(0, models.VOCAB, (n, SEQ), generator=g) for _ in range(2)]
    for i, ids in enumerate(halves):  # two micro-batches, the first without communication
        with model.no_sync() if i == 0 else contextlib.nullcontext():
            _loss(model, ids.chunk(n)[rank]).backward()
    sum(torch.stack([_loss(ref, s) for s in ids.chunk(n)]).mean() for ids in halves).backward()
    _check_grads(model, ref, "no_sync")
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
        _loss(model, ids).backward()
        grads.append(_grads(model))
        del model
        gc.collect()
    for other in grads[1:]:
        for name, g in grads[0].items():
            assert torch.equal(other[name], g), name
    return {"compared": len(grads[0])}


def test_offload_and_memory_budget_under_ep2(tmp_path) -> None:
    assert all(got["compared"] > 0 for got in run_distributed(_offload_body, 2, str(tmp_path)))
