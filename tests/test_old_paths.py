"""Every module path the package had before its folders (docs/design.md, "The map") still imports, as the
very module at its new home: BMTrain's paths (``bmt.store``, ``from bmt_wrap.store import ...``,
``bmt.nn``) and ours (``bmt_wrap.plan``, ``bmt_wrap.checkpoint``, ``bmt_wrap.distributed``)."""

from __future__ import annotations

import importlib
import sys

import pytest

import bmt_wrap as bmt

# The paths as they were, written out (not read from the alias table, so dropping an alias fails here).
OLD_PATHS = [
    *(f"bmt_wrap.{m}" for m in (
        "_compat", "dtypes", "log", "mixed_precision", "plan", "prefetch_schedule",  # now base/
        "collectives", "distributed",  # job/
        "apply_plan", "compiled", "consistency", "gathered", "generate", "init", "sharded_module", "verify",
        "wrapper",  # wrapping/
        "block", "module",  # explicit/
        "block_layer", "global_var", "inspect", "nccl", "nn", "nn.linear", "nn.column_parallel_linear",
        "nn.row_parallel_linear", "nn.parallel_embedding", "nn.parallel_linear_func", "pipe_layer",
        "store", "synchronize", "utils",  # bmtrain/
        "checkpoint", "checkpoint.agree", "checkpoint.atomic", "checkpoint.consolidated", "checkpoint.dcp",
        "checkpoint.entries", "checkpoint.formats", "checkpoint.local_shard", "checkpoint.optim_shards",
        "checkpoint.optim_state", "checkpoint.rng", "checkpoint.sharded",  # save_load/
        "runtime.block_function", "runtime.process_engine")),  # runtime/block_executor, active_engine
]


@pytest.mark.parametrize("old", OLD_PATHS)
def test_an_old_path_is_the_module_at_its_new_home(old: str) -> None:
    module = importlib.import_module(old)
    assert module.__name__ != old and module.__name__.startswith("bmt_wrap."), module.__name__
    assert module is importlib.import_module(module.__name__) and module.__spec__.name == module.__name__
    assert sys.modules[old] is module


def test_bmtrains_imports_as_scripts_write_them() -> None:
    from bmt_wrap.block_layer import CheckpointBlock
    from bmt_wrap.checkpoint.formats import open_source
    from bmt_wrap.nn.linear import Linear
    from bmt_wrap.store import load, save

    assert (save, load) == (bmt.save, bmt.load) and CheckpointBlock is bmt.CheckpointBlock
    assert Linear is bmt.nn.Linear
    assert open_source is importlib.import_module("bmt_wrap.save_load.formats").open_source
    for name in ("store", "nccl", "global_var", "pipe_layer", "block_layer", "utils", "inspect",
                 "nn", "distributed", "checkpoint", "plan"):
        assert getattr(bmt, name) is importlib.import_module(f"bmt_wrap.{name}"), name
    # Functions named like a module (BMTrain's synchronize, our gathered, wrap) stay functions.
    assert callable(bmt.synchronize) and callable(bmt.gathered) and callable(bmt.wrap)


def test_the_console_script_and_public_names_resolve() -> None:
    from bmt_wrap.cli import main

    assert callable(main)
    missing = [n for n in bmt.__all__ if getattr(bmt, n, None) is None]
    assert not missing, missing


def test_the_passes_old_names_are_the_new_ones() -> None:
    from bmt_wrap import passes

    assert passes.rewrite is passes.schedule_graph and passes.Block is passes.DiscoveredBlock
