"""One transformers architecture through bmt_wrap: build it small from its default config, train it plainly,
then wrapped at world size 1 (dropout on: bit-exact) and 2 (dropout off: docs/design.md's tolerances).

``benchmarks/coverage.py`` runs this for every model type in transformers' auto mappings and writes
``docs/coverage.md``; ``tests/test_coverage_sample.py`` runs a fixed sample through the same functions.

The shrinker changes sizes only: layers 2 (every ``num_*layers`` field, encoder and decoder too), hidden
width about 64, 4 heads / 2 key-value heads, intermediate about 128, vocabulary 256, images 32 px (patches
4 px), token ids folded into the vocabulary. Every other default stays (``use_cache`` included); the one
exception is dropout, drop-path, layer-drop and a router's jitter noise (training-time random draws), set
to 0 for the two-rank comparison, because two ranks' random streams cannot equal one process's; at world
size 1 they stay on and must match bit for bit. Nothing is downloaded.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_TESTS = Path(__file__).resolve().parent.parent / "tests"
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))

from dist_harness import DistributedTestError, run_distributed  # noqa: E402
from parity import train_side_by_side  # noqa: E402

KINDS: dict[str, str] = {  # kind -> transformers.models.auto.modeling_auto mapping
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "seq-cls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "image-cls": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}

AUTO = {"causal-lm": "AutoModelForCausalLM", "masked-lm": "AutoModelForMaskedLM",
        "seq2seq-lm": "AutoModelForSeq2SeqLM", "seq-cls": "AutoModelForSequenceClassification",
        "image-cls": "AutoModelForImageClassification"}

VOCAB = 256
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 128
LAYERS = 2
IMAGE = 32
PATCH = 4
LORA_RANK = 32
BATCH = 4  # global batch: 2 rows per rank at N=2
SEQ = 16
STEPS = 3
RESEED = 1234  # N=1, dropout on: both models draw their masks from this seed each step


def cases(kinds: list[str] | None = None) -> list[tuple[str, str, str]]:
    """Every (kind, model type, class name) in the auto mappings for ``kinds`` (all five by default)."""
    from transformers.models.auto import modeling_auto

    out = []
    for kind in kinds or list(KINDS):
        for model_type, cls in getattr(modeling_auto, KINDS[kind]).items():
            out.append((kind, model_type, cls[0] if isinstance(cls, (tuple, list)) else cls))
    return out


# ---- the shrinker -----------------------------------------------------------------------------------
_LAYER_KEYS_EXCLUDE = ("shared", "window", "dense", "nextn", "predict", "kv_", "cache", "sparse")


def _is_layers(k: str) -> bool:
    if any(x in k for x in _LAYER_KEYS_EXCLUDE):
        return False
    return k in ("n_layer", "n_layers", "num_layers", "num_blocks", "depth") or (
        k.endswith("_layers") and (k.startswith("num_") or k.startswith("n_") or "encoder" in k or "decoder" in k))


_HIDDEN_KEYS = {"hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "dim", "embedding_size",
                "word_embed_proj_dim", "d_embed", "emb_dim", "embedding_dim", "d_latents", "true_hidden_size",
                "intra_bottleneck_size", "attention_hidden_size", "projection_dim", "pooler_hidden_size",
                "decoder_hidden_size", "input_embedding_size", "output_embedding_size", "d_rel", "lru_width",
                "entity_emb_size", "hidden_size_per_layer_input", "xpath_unit_hidden_size", "backbone_hidden_size",
                "axial_pos_embds_dim", "router_hidden_size", "pooler_output_size"}
_CHANNEL_LISTS = ("hidden_sizes", "embed_dims", "dims", "neck_hidden_sizes", "stage_out_channels",
                  "stage_mid_channels", "stage_in_channels")
_INTERMEDIATE_KEYS = {"d_ff", "n_inner", "d_inner", "dim_ff", "dff", "feed_forward_size"}


def _is_heads(k: str) -> bool:
    return ("heads" in k or k in ("n_head", "num_head")) and "per_" not in k


def _is_kv_heads(k: str) -> bool:
    return _is_heads(k) and any(x in k for x in ("key_value", "kv", "key_heads", "query_groups")) or k in (
        "multi_query_group_num", "num_query_groups")


def _fold(token: Any, vocab: int) -> Any:
    if isinstance(token, bool) or token is None:
        return token
    if isinstance(token, int):
        return token % vocab if token >= vocab else token
    if isinstance(token, list):
        return [_fold(t, vocab) for t in token]
    return token


def _shrink_dict(d: dict[str, Any], dropout: bool) -> dict[str, Any]:
    """The shrunk copy of one config's ``to_dict()`` (sub-configs recursively)."""
    out = dict(d)
    mha = d.get("num_key_value_heads") is not None and d.get("num_key_value_heads") == d.get("num_attention_heads")
    layers_before = {k: v for k, v in d.items() if _is_layers(k) and isinstance(v, int) and not isinstance(v, bool)}
    width = max((max(v) for k, v in d.items() if k in _CHANNEL_LISTS and isinstance(v, list) and v
                 and all(isinstance(x, int) for x in v)), default=0)
    pyramid = isinstance(d.get("depths"), list) and len(d["depths"]) > 1
    orig_image = d.get("image_size")
    for k, v in d.items():
        if isinstance(v, dict) and ("model_type" in v or any(isinstance(x, (int, float)) for x in v.values())) \
                and k not in ("id2label", "label2id", "rope_parameters", "rope_scaling"):
            out[k] = _shrink_dict(v, dropout)
            continue
        if isinstance(v, bool):
            continue
        if isinstance(v, int):
            if k in layers_before:
                out[k] = min(v, LAYERS) if v > 0 else v
            elif k in _HIDDEN_KEYS:
                if k == "embed_dim" and pyramid:  # doubled per stage: the last stage ends near HIDDEN
                    out[k] = max(8, HIDDEN >> (len(d["depths"]) - 1))
                elif v > HIDDEN:
                    out[k] = HIDDEN
            elif k == "rotary_dim":
                out[k] = min(v, HEAD_DIM)
            elif k == "window_size" and "image_size" in d:
                out[k] = min(v, PATCH)
            elif k == "num_groups" and "hidden_sizes" in d:  # GroupNorm groups must divide the shrunk widths
                out[k] = min(v, 4)
            elif k.endswith("head_dim") or k in ("d_kv", "kv_channels", "attention_head_dim", "d_head", "dim_head",
                                                 "attention_head_size", "head_size"):
                out[k] = min(v, HEAD_DIM if k != "qk_head_dim" else 2 * HEAD_DIM)
            elif k.endswith("lora_rank") or k in ("kv_lora_rank", "q_lora_rank", "o_lora_rank", "laurel_rank"):
                out[k] = min(v, LORA_RANK)
            elif _is_kv_heads(k):
                out[k] = min(v, HEADS if mha else KV_HEADS)  # multi-head attention stays multi-head
            elif _is_heads(k):
                out[k] = min(v, HEADS)
            elif "intermediate" in k or "ffn_dim" in k or "ffn_hidden" in k or k in _INTERMEDIATE_KEYS:
                out[k] = min(v, INTERMEDIATE)
            elif k == "vocab_size" and v is None:
                out[k] = VOCAB
            elif k == "vocab_size" or k.endswith("_vocab_size") or k.endswith("vocab_size_per_layer_input"):
                out[k] = min(v, VOCAB)
            elif k == "image_size":
                out[k] = IMAGE
            elif k == "patch_size":
                out[k] = min(v, PATCH)
        elif isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            if k in ("depths", "num_block_repeats", "block_repeats", "stage_num_blocks", "stage_numb_of_layers"):
                out[k] = [min(x, LAYERS) for x in v]
            elif k in _CHANNEL_LISTS and width > HIDDEN:  # one factor for every channel list: they chain
                out[k] = [max(1, int(round(x * HIDDEN / width))) for x in v]
            elif _is_heads(k) and len(v) > 1:  # per stage, doubling with the width: keep the ratios
                out[k] = [max(1, x // v[0]) for x in v]
            elif k == "image_size":
                out[k] = [IMAGE] * len(v)
            elif k.endswith("token_id") or k.endswith("token_ids"):
                out[k] = _fold(v, VOCAB)
        if dropout is False and ("drop" in k or k.endswith("_pdrop") or "jitter" in k):
            if isinstance(v, float) and v > 0:
                out[k] = 0.0
            elif isinstance(v, list) and any(isinstance(x, float) and x > 0 for x in v):
                out[k] = [0.0 if isinstance(x, float) else x for x in v]  # per-stage rates (CvT's drop_path_rate)
    if "vocab_size" in d and d["vocab_size"] is None:
        out["vocab_size"] = VOCAB
    vocab = out.get("vocab_size") if isinstance(out.get("vocab_size"), int) else VOCAB
    for k, v in d.items():
        if (k.endswith("_token_id") or k.endswith("_token_index") or k.endswith("token_ids")) and not isinstance(v, dict):
            out[k] = _fold(v, vocab)
    if isinstance(orig_image, int) and isinstance(d.get("patch_size"), int):
        out["patch_size"] = min(d["patch_size"], PATCH)
    # Lists with one entry per layer (layer_types, mlp_layer_types, ...) follow the layer count; a kind of
    # layer the first ones lack (a hybrid's full attention) takes the last place, so every kind is built.
    for k, n in layers_before.items():
        m = out[k]
        if m == n:
            continue
        for lk, lv in d.items():
            if lk == k:
                continue
            if isinstance(lv, list) and len(lv) == n and (n > 4 or "layer" in lk or "block" in lk
                                                          or lk.endswith("_types") or lk.endswith("_pattern")):
                cut = list(lv[:m])
                missing = [x for x in lv if isinstance(x, str) and x not in cut]
                if missing and m > 1:
                    cut[-1] = missing[0]
                out[lk] = cut
            elif isinstance(lv, dict) and lv and all(str(x).isdigit() for x in lv):  # per-layer overrides
                out[lk] = {x: y for x, y in lv.items() if int(x) < m}
        for lk in ("out_features", "out_indices", "stage_names"):
            if lk in d:
                out[lk] = None
    return out


def _changes(base: dict[str, Any], shrunk: dict[str, Any]) -> dict[str, Any]:
    """Only what the shrinker changed (sub-configs as partial dicts), so derived defaults are derived again."""
    out = {}
    for k, v in shrunk.items():
        b = base.get(k)
        if isinstance(v, dict) and isinstance(b, dict) and k not in ("id2label", "label2id") and not (
                b and all(str(x).isdigit() for x in b)):
            sub = _changes(b, v)
            if sub:
                out[k] = sub
        elif v != b:
            out[k] = v
    return out


def shrink_config(model_type: str, dropout: bool = True):
    """The model type's default config, shrunk (see the module docstring); ``dropout=False`` zeroes dropout."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    base = default.to_dict()
    return cls(**_changes(base, _shrink_dict(base, dropout)))


def build_model(kind: str, model_type: str, class_name: str, dropout: bool = True) -> nn.Module:
    """The seeded model (fp32, CPU, train mode) of ``class_name`` on the shrunk config."""
    import transformers

    cfg = shrink_config(model_type, dropout)
    if kind == "seq-cls" and getattr(cfg, "pad_token_id", None) is None:
        # Batched sequence classification finds each row's last token through the pad id.
        cfg.pad_token_id = _vocab(cfg) - 1
    auto = getattr(transformers, AUTO[kind])
    torch.manual_seed(0)
    model = auto.from_config(cfg).float()  # the auto class: composite configs hand their text config on
    if type(model).__name__ != class_name:
        raise TypeError(f"{AUTO[kind]} built {type(model).__name__}, the mapping says {class_name}")
    model.train()
    return model


def _sub(cfg: Any, *names: str) -> Any:
    for name in names:
        sub = getattr(cfg, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            return sub
    return cfg


def _vocab(cfg: Any) -> int:
    v = getattr(cfg, "vocab_size", None) or getattr(_sub(cfg, "text_config", "decoder"), "vocab_size", None)
    return int(v) if isinstance(v, int) and v > 0 else VOCAB


def make_batches(kind: str, cfg: Any, steps: int = STEPS, batch: int = BATCH, seq: int = SEQ,
                 seed: int = 7) -> list[tuple[torch.Tensor, ...]]:
    """Deterministic global batches for one kind: token ids avoid the pad id; labels are folded into the
    model's output width by the loss."""
    g = torch.Generator().manual_seed(seed)
    vocab = _vocab(cfg)
    pad = getattr(cfg, "pad_token_id", None)

    def ids() -> torch.Tensor:
        t = torch.randint(0, vocab, (batch, seq), generator=g)
        if isinstance(pad, int) and 0 <= pad < vocab:
            t = torch.where(t == pad, (t + 1) % vocab, t)
        return t

    def labels(*shape: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, shape, generator=g)

    out = []
    for _ in range(steps):
        if kind == "causal-lm":
            out.append((ids(),))
        elif kind == "masked-lm":
            out.append((ids(), labels(batch, seq)))
        elif kind == "seq2seq-lm":
            out.append((ids(), ids(), labels(batch, seq)))
        elif kind == "seq-cls":
            out.append((ids(), labels(batch)))
        else:
            vc = _sub(cfg, "vision_config", "backbone_config")
            size = getattr(vc, "image_size", IMAGE)
            size = size if isinstance(size, int) else IMAGE
            channels = getattr(vc, "num_channels", 3) or 3
            out.append((torch.randn(batch, channels, size, size, generator=g), labels(batch)))
    return out


def _logits(out: Any) -> torch.Tensor:
    logits = getattr(out, "logits", None)
    if logits is None:
        logits = out[0] if isinstance(out, (tuple, list)) else out
    return logits.float()


def _ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1) % logits.shape[-1])


def loss_fn(kind: str) -> Callable[..., torch.Tensor]:
    """``loss(model, *batch)`` for one kind: cross-entropy from the logits (next token for causal LMs)."""
    if kind == "causal-lm":
        def causal(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
            logits = _logits(model(input_ids=ids))
            return _ce(logits[:, :-1], ids[:, 1:])
        return causal
    if kind == "seq2seq-lm":
        def seq2seq(model: nn.Module, ids: torch.Tensor, dec: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return _ce(_logits(model(input_ids=ids, decoder_input_ids=dec)), labels)
        return seq2seq
    if kind == "image-cls":
        def image(model: nn.Module, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return _ce(_logits(model(pixel_values=pixels)), labels)
        return image

    def text(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _ce(_logits(model(input_ids=ids)), labels)
    return text


@contextmanager
def deterministic() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` for the comparisons, restored after.

    Some CPU kernels are not reproducible run to run (``index_add_`` over several threads, as MoE token
    dispatch uses): two plain runs of such a model already differ in the last bits, so bit-exactness
    against plain PyTorch is only defined with deterministic algorithms, in both models alike.
    """
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def has_batchnorm(model: nn.Module) -> bool:
    """Batch statistics (BatchNorm and relatives) make each rank's forward depend on its own rows."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def reason(exc: BaseException) -> str:
    """Exception type and the first line of its message."""
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first.strip()[:300]}"


def _plan_info(model: nn.Module) -> dict[str, Any]:
    plan = model.plan
    blocks = plan.blocks()
    return {"capture": plan.capture, "blocks": len(blocks),
            "checkpointed": sum(1 for g in blocks if g.checkpoint),
            "block_names": [g.name for g in blocks][:8]}


# ---- bodies: run inside dist_harness workers --------------------------------------------------------
def plain_body(kind: str, model_type: str, class_name: str) -> dict[str, Any]:
    """World size 1: build, one plain training step, then wrapped vs plain with dropout on (bit-exact)."""
    import bmt_wrap as bmt

    rec: dict[str, Any] = {"built": False, "plain": False}
    t0 = time.perf_counter()
    try:
        model = build_model(kind, model_type, class_name, dropout=True)
    except Exception as exc:  # noqa: BLE001 - every failure is data here
        rec.update(stage="build", reason=reason(exc), trace=traceback.format_exc()[-2000:])
        return rec
    rec["built"] = True
    rec["params"] = sum(p.numel() for p in model.parameters())
    rec["batchnorm"] = has_batchnorm(model)
    rec["dropout_modules"] = sum(1 for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0)
    batches = make_batches(kind, model.config)
    loss = loss_fn(kind)
    try:
        plain = copy.deepcopy(model)
        opt = torch.optim.SGD(plain.parameters(), lr=0.1)
        value = loss(plain, *batches[0])
        value.backward()
        opt.step()
        if not math.isfinite(float(value)):
            raise FloatingPointError(f"plain loss is {float(value)}")
        del plain, opt
    except Exception as exc:  # noqa: BLE001
        rec.update(stage="plain", reason=reason(exc), trace=traceback.format_exc()[-2000:])
        return rec
    rec["plain"] = True
    rec["plain_s"] = time.perf_counter() - t0
    wrapped: dict[str, nn.Module] = {}

    def wrap(m: nn.Module) -> nn.Module:
        wrapped["m"] = bmt.BMTrainModelWrapper(m)
        return wrapped["m"]

    try:
        with deterministic():
            res = train_side_by_side(lambda: model, wrap, batches, optimizer="sgd", loss_fn=loss, strict=False,
                                     reseed=RESEED, check_buffers=True)
    except Exception as exc:  # noqa: BLE001
        rec.update(n1_stage="wrap" if "m" not in wrapped else "train", n1_reason=reason(exc),
                   n1_trace=traceback.format_exc()[-3000:])
        if "m" in wrapped:
            rec.update(_plan_info(wrapped["m"]))
        return rec
    rec.update(_plan_info(wrapped["m"]))
    exact = (res["losses"] == res["ref_losses"] and res["grad_diff"] == 0.0 and res["param_diff"] == 0.0
             and res["buffer_diff"] == 0.0)
    rec.update(n1_exact=exact, n1_loss=res["loss_diff"], n1_grad=res["grad_diff"], n1_param=res["param_diff"],
               n1_buffer=res["buffer_diff"], n1_failures=res["failures"][:3])
    return rec


def parity_body(kind: str, model_type: str, class_name: str, sliced: bool | None = None) -> dict[str, Any]:
    """World size 2, dropout off: plain on the global batch (or, with BatchNorm, on each rank's slice with
    the gradients averaged) vs wrapped on this rank's slice, 3 SGD steps, docs/design.md's tolerances. When the
    global reference disagrees, the sliced one is tried too, to tell batch-coupled models from engine bugs."""
    import bmt_wrap as bmt

    rec: dict[str, Any] = {}
    try:
        model = build_model(kind, model_type, class_name, dropout=False)
    except Exception as exc:  # noqa: BLE001
        return {"n2_stage": "build", "n2_reason": reason(exc)}
    batches = make_batches(kind, model.config)
    loss = loss_fn(kind)
    sliced = has_batchnorm(model) if sliced is None else sliced
    wrapped: dict[str, nn.Module] = {}

    def wrap(m: nn.Module) -> nn.Module:
        wrapped["m"] = bmt.BMTrainModelWrapper(m)
        return wrapped["m"]

    try:
        with deterministic():
            res = train_side_by_side(lambda: copy.deepcopy(model), wrap, batches, optimizer="sgd", loss_fn=loss,
                                     strict=False, sliced_reference=sliced, check_buffers=sliced)
    except Exception as exc:  # noqa: BLE001
        rec.update(n2_stage="wrap" if "m" not in wrapped else "train", n2_reason=reason(exc),
                   n2_trace=traceback.format_exc()[-3000:])
        if "m" in wrapped:
            rec.update({f"n2_{k}": v for k, v in _plan_info(wrapped["m"]).items()})
        return rec
    rec.update({f"n2_{k}": v for k, v in _plan_info(wrapped["m"]).items()})
    rec.update(n2_reference="sliced" if sliced else "global", n2_loss=res["loss_diff"], n2_grad=res["grad_diff"],
               n2_param=res["param_diff"], n2_buffer=res["buffer_diff"], n2_failures=res["failures"][:3],
               n2_failure_count=len(res["failures"]), n2_ok=not res["failures"])
    # Each rank checks its own slices: agree before deciding to run more collectives.
    any_failed = float(bmt.sum_loss(torch.tensor(1.0 if res["failures"] else 0.0))) > 0
    if any_failed and not sliced:
        try:
            with deterministic():
                again = train_side_by_side(lambda: copy.deepcopy(model), lambda m: bmt.BMTrainModelWrapper(m),
                                           batches, optimizer="sgd", loss_fn=loss, strict=False,
                                           sliced_reference=True)
            rec["n2_sliced_ok"] = not again["failures"]
            rec["n2_sliced_failures"] = again["failures"][:2]
        except Exception as exc:  # noqa: BLE001
            rec["n2_sliced_ok"] = False
            rec["n2_sliced_reason"] = reason(exc)
    return rec


def _merge_ranks(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from every rank's: each rank compared its own slices."""
    out = dict(results[0])
    for key in ("n2_loss", "n2_grad", "n2_param", "n2_buffer"):
        vals = [r[key] for r in results if r.get(key) is not None]
        if vals:
            out[key] = max(vals)
    for key in ("n2_ok", "n2_sliced_ok"):
        vals = [r[key] for r in results if key in r]
        if vals:
            out[key] = all(vals)
    for key in ("n2_failures", "n2_sliced_failures"):
        merged = [f"rank {i}: {f}" for i, r in enumerate(results) for f in r.get(key, [])]
        if merged or key in out:
            out[key] = merged[:4]
    out["n2_failure_count"] = sum(r.get("n2_failure_count", 0) for r in results)
    for r in results[1:]:
        if r.get("n2_reason") and not out.get("n2_reason"):
            out.update(n2_stage=r["n2_stage"], n2_reason=r["n2_reason"])
    return out


# ---- one case, two worker groups ---------------------------------------------------------------------
def _call(fn: Callable, world_size: int, timeout: float, *args: Any) -> tuple[dict[str, Any] | None, str | None]:
    try:
        results = run_distributed(fn, world_size, *args, timeout=timeout)
    except DistributedTestError as exc:
        text = "\n".join(exc.errors)
        if "hung" in text:
            return None, f"Timeout: no result within {timeout:.0f} s (hung)"
        if "died" in text:
            return None, "WorkerDied: " + next(e for e in exc.errors if "died" in e).split(": ", 1)[-1]
        last = [line for line in text.splitlines() if line.strip() and not line.startswith(" ")]
        return None, (last[1] if len(last) > 1 else text[:300])
    except RuntimeError as exc:  # the group could not start
        return None, reason(exc)
    return _merge_ranks(results) if world_size > 1 else results[0], None


def run_case(kind: str, model_type: str, class_name: str, timeout: float = 300.0) -> dict[str, Any]:
    """Everything recorded for one (kind, model type): see ``plain_body`` and ``parity_body``."""
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"kind": kind, "model_type": model_type, "class": class_name}
    one, err = _call(plain_body, 1, timeout, kind, model_type, class_name)
    if one is None:
        rec.update(built=False, plain=False, stage="N=1", reason=err)
    else:
        rec.update(one)
    if rec.get("plain"):
        two, err = _call(parity_body, 2, timeout, kind, model_type, class_name)
        if two is None:
            rec.update(n2_stage="run", n2_reason=err)
        else:
            rec.update(two)
    # N=2 passes against the global batch, or against the data-parallel reference (each rank's slice,
    # gradients averaged) where the two references differ by nature (batch coupling, fp32 sums over a
    # different batch split): what DDP would compute.
    rec["n2_pass"] = bool(rec.get("n2_ok") or rec.get("n2_sliced_ok"))
    rec["passed"] = bool(rec.get("plain") and rec.get("n1_exact") and rec["n2_pass"])
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    return rec


def failure_reason(rec: dict[str, Any]) -> str:
    """The one line that says why a case did not pass (empty when it passed)."""
    if rec.get("passed"):
        return ""
    if not rec.get("plain"):
        return f"{rec.get('stage', '?')}: {rec.get('reason', '?')}"
    parts = []
    if rec.get("n1_reason"):
        parts.append(f"N=1 {rec['n1_stage']}: {rec['n1_reason']}")
    elif not rec.get("n1_exact"):
        first = (rec.get("n1_failures") or ["not bit-exact (within tolerance)"])[0].splitlines()[0]
        parts.append(f"N=1 not bit-exact: {first}")
    if rec.get("n2_reason"):
        parts.append(f"N=2 {rec['n2_stage']}: {rec['n2_reason']}")
    elif not rec.get("n2_pass"):
        first = (rec.get("n2_failures") or ["?"])[0].splitlines()[0]
        parts.append(f"N=2 parity: {first}")
    return "; ".join(parts)


os.environ.setdefault("OMP_NUM_THREADS", "1")
