"""The resident bytes a training rank holds beside the tensors the plan counts (bmt_wrap/process_baseline.py):
the baseline once, and per layer of a model grown by layers (``bmt-wrap plan --memory --grow``)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bmt_wrap.cli import main
from bmt_wrap.process_baseline import grows_by_layers, live_tensor_bytes

MIB = 2**20

# A wide MLP (7.3M parameters a layer): about 4 layers fit the test's 1.5 GiB, so the search for the largest
# builds and captures 5 models of at most 8 layers (with a 1024-wide MLP, 14 fit: 7 captures up to 16 layers).
_FACTORY = '''
def llama(n_layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=4096,
                                        num_attention_heads=4, num_hidden_layers=n_layers))
'''


def test_live_tensor_bytes_counts_each_storage_once() -> None:
    t = torch.empty(4 * MIB, dtype=torch.uint8)
    views = [t[:MIB], t.view(2, -1), t[MIB:]]
    gc.collect()
    with_t = live_tensor_bytes()
    del t, views
    gc.collect()
    assert with_t - live_tensor_bytes() == 4 * MIB  # the views share t's storage


def test_only_a_layer_count_grows_the_bytes_beside_tensors() -> None:
    assert all(map(grows_by_layers, ["n_layers", "num_hidden_layers", "n_layer", "num_layers"]))
    assert not any(map(grows_by_layers, ["hidden_size", "n_embd", "vocab_size"]))


def test_plan_memory_grow_counts_what_each_layer_adds_beside_its_tensors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rank holds about 1 MiB beside its tensors per transformers layer (the heap around a layer's
    small tensors, the runtime's per-block state); the one-layer baseline misses it. The CLI measures
    it from real steps at 2 and 4 layers and adds it per layer above the first."""
    (tmp_path / "factory.py").write_text(_FACTORY)
    argv = ["plan", f"{tmp_path / 'factory.py'}:llama", "--world-size", "2", "--memory", "1.5GiB", "--grow",
            "n_layers", "--input", "input_ids=int64[2,32]", "--input", "labels=int64[2,32]", "--json"]
    # Measured in a fresh process (its resident bytes are the measurement); a given --baseline measures
    # nothing, so this process answers it.
    out = subprocess.run([sys.executable, "-c", "import sys; from bmt_wrap.cli import main; sys.exit(main())", *argv],
                         capture_output=True, text=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert out.returncode == 0, out.stderr[-3000:]
    measured = json.loads(out.stdout)
    assert main([*argv, "--baseline", "400MiB"]) == 0
    given = json.loads(capsys.readouterr().out)
    assert 0 < measured["beside_per_layer"] < 8 * MIB, measured
    assert given["beside_per_layer"] == 0  # a --baseline is taken as given: nothing is measured
    k = measured["layers"]
    assert measured["beside"] == measured["beside_per_layer"] * (k - 1) and given["beside"] == 0
    # Wrapping runs before the first step, on the process with its libraries imported and nothing run;
    # training on the baseline, which adds what a first step leaves for good.
    before = measured["baseline_before_training"]
    assert 0 < before < measured["baseline"], measured
    assert given["baseline_before_training"] is None  # a --baseline stands for both
    assert measured["counted_per_rank"] == measured["beside"] + max(
        before + measured["wrapping"], measured["baseline"] + max(measured["training_phases"].values()))
    assert given["counted_per_rank"] == given["baseline"] + max(given["wrapping"],
                                                                *given["training_phases"].values())
    for answer in (measured, given):  # the answer fits the count and the margin kept for its known error
        assert answer["peak_per_rank"] == answer["counted_per_rank"] + answer["margin"]
