"""A fixed sample of benchmarks/coverage.py's sweep, through the same code (benchmarks/arch_sweep.py): real
transformers models from their default configs (sizes shrunk, ``use_cache`` and every other default kept),
one plain step, then wrapped at world size 1 with dropout on (bit-exact) and at 2 gloo ranks with dropout
off (docs/design.md's tolerances; ResNet's BatchNorm against plain PyTorch fed each rank's slice)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import arch_sweep  # noqa: E402

# (kind, model type, fewest blocks discovery must find): causal LMs, encoders, encoder-decoders, vision.
SAMPLE = [
    ("causal-lm", "gpt2", 2),
    ("causal-lm", "llama", 2),
    ("causal-lm", "gpt_neox", 2),
    ("causal-lm", "mistral", 2),
    ("causal-lm", "opt", 2),
    ("seq-cls", "bert", 2),
    ("masked-lm", "roberta", 2),
    ("seq2seq-lm", "t5", 0),
    # The encoder output is read by every decoder layer: bit-exact at N=1 only when autograd sums its
    # gradient in plain PyTorch's order (blocks run in the model's own graph).
    ("seq2seq-lm", "bart", 4),
    ("image-cls", "vit", 2),
    ("image-cls", "convnext", 2),
    ("image-cls", "resnet", 0),
]


def _class(kind: str, model_type: str) -> str:
    return next(c for k, t, c in arch_sweep.cases([kind]) if t == model_type)


@pytest.mark.parametrize(("kind", "model_type", "min_blocks"), SAMPLE, ids=[f"{c.values[0]}-{c.values[1]}" if hasattr(c, "values") else f"{c[0]}-{c[1]}" for c in SAMPLE])
def test_sample_architecture_matches_plain_pytorch(kind: str, model_type: str, min_blocks: int) -> None:
    rec = arch_sweep.run_case(kind, model_type, _class(kind, model_type), timeout=240)
    assert rec["built"] and rec["plain"], f"{model_type} did not build or train plainly: {rec.get('reason')}"
    assert rec["params"] > 0 and rec.get("capture") in ("fx", "export", "eager"), rec.get("capture")
    why = arch_sweep.failure_reason(rec)
    assert rec.get("n1_exact"), f"N=1 with dropout on is not bit-exact: {why}"
    assert rec.get("n2_pass"), f"N=2 parity: {why}"
    assert rec["n2_reference"] == ("sliced" if rec["batchnorm"] else "global")
    assert rec["n2_loss"] <= 1e-4 and rec["n2_grad"] <= 1e-3 and rec["n2_param"] <= 1e-3, rec
    assert rec["n2_blocks"] >= min_blocks, f"blocks found: {rec['n2_block_names']}"
    assert rec["n2_checkpointed"] <= rec["n2_blocks"]
    assert rec["passed"], why
    if model_type == "resnet":  # batch statistics: the per-rank-slice reference, buffers compared too
        assert rec["batchnorm"] and rec["n2_buffer"] == 0.0


def test_two_rank_configs_turn_off_every_dropout_rate_lists_included() -> None:
    # CvT keeps per-stage drop-path rates in a list: left on, two ranks drew other masks than one process.
    cfg = arch_sweep.shrink_config("cvt", dropout=False)
    assert cfg.drop_path_rate and all(r == 0.0 for r in cfg.drop_path_rate), cfg.drop_path_rate
    assert any(r > 0 for r in arch_sweep.shrink_config("cvt", dropout=True).drop_path_rate)


def test_two_rank_config_zeroes_router_jitter_noise() -> None:
    # PhiMoE's router multiplies its logits by random jitter in training: two ranks draw other numbers
    # than one process, so the two-rank comparison turns it off like dropout (N=1 keeps it, bit-exact).
    assert arch_sweep.shrink_config("phimoe", dropout=True).router_jitter_noise > 0
    assert arch_sweep.shrink_config("phimoe", dropout=False).router_jitter_noise == 0.0
