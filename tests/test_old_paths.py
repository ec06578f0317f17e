"""Every module path the package had before its folders (docs/design.md, "The map") still imports, as the
very module at its new home: BMTrain's paths (``bmt.store``, ``from bmt_wrap.store import ...``,
``bmt.nn``) and ours (``bmt_wrap.plan``, ``bmt_wrap.checkpoint``, ``bmt_wrap.distributed``)."""

from __future__ import annotations

import importlib
import sys

import pytest

import bmt_wrap as bmt

# The paths as they were, written out (not read from the alias table, so dropping an alias fails here).
OLD_PATHS = {
    "bmt_wrap._compat": "bmt_wrap.base._compat",
    "bmt_wrap.dtypes": "bmt_wrap.base.dtypes",
    "bmt_wrap.log": "bmt_wrap.base.log",
    "bmt_wrap.mixed_precision": "bmt_wrap.base.mixed_precision",
    "bmt_wrap.plan": "bmt_wrap.base.plan",
    "bmt_wrap.prefetch_schedule": "bmt_wrap.base.prefetch_schedule",
    "bmt_wrap.collectives": "bmt_wrap.job.collectives",
    "bmt_wrap.distributed": "bmt_wrap.job.distributed",
    "bmt_wrap.apply_plan": "bmt_wrap.wrapping.apply_plan",
    "bmt_wrap.compiled": "bmt_wrap.wrapping.compiled",
    "bmt_wrap.consistency": "bmt_wrap.wrapping.consistency",
    "bmt_wrap.gathered": "bmt_wrap.wrapping.gathered",
    "bmt_wrap.generate": "bmt_wrap.wrapping.generate",
    "bmt_wrap.init": "bmt_wrap.wrapping.init",
    "bmt_wrap.sharded_module": "bmt_wrap.wrapping.sharded_module",
    "bmt_wrap.verify": "bmt_wrap.wrapping.verify",
    "bmt_wrap.wrapper": "bmt_wrap.wrapping.wrapper",
    "bmt_wrap.block": "bmt_wrap.explicit.block",
    "bmt_wrap.module": "bmt_wrap.explicit.module",
    "bmt_wrap.block_layer": "bmt_wrap.bmtrain.block_layer",
    "bmt_wrap.global_var": "bmt_wrap.bmtrain.global_var",
    "bmt_wrap.inspect": "bmt_wrap.bmtrain.inspect",
    "bmt_wrap.nccl": "bmt_wrap.bmtrain.nccl",
    "bmt_wrap.nn": "bmt_wrap.bmtrain.nn",
    "bmt_wrap.nn.linear": "bmt_wrap.bmtrain.nn.linear",
    "bmt_wrap.nn.parallel": "bmt_wrap.bmtrain.nn.parallel",
    "bmt_wrap.pipe_layer": "bmt_wrap.bmtrain.pipe_layer",
    "bmt_wrap.store": "bmt_wrap.bmtrain.store",
    "bmt_wrap.synchronize": "bmt_wrap.bmtrain.synchronize",
    "bmt_wrap.utils": "bmt_wrap.bmtrain.utils",
    "bmt_wrap.checkpoint": "bmt_wrap.save_load",
    **{f"bmt_wrap.checkpoint.{m}": f"bmt_wrap.save_load.{m}"
       for m in ("agree", "atomic", "consolidated", "dcp", "entries", "formats", "local_shard", "optim_shards",
                 "optim_state", "rng", "sharded")},
    "bmt_wrap.runtime.block_function": "bmt_wrap.runtime.block_executor",
    "bmt_wrap.runtime.process_engine": "bmt_wrap.runtime.active_engine",
}


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_an_old_path_is_the_module_at_its_new_home(old: str) -> None:
    module = importlib.import_module(old)
    assert module is importlib.import_module(OLD_PATHS[old])
    assert module.__name__ == OLD_PATHS[old] and module.__spec__.name == OLD_PATHS[old]
    assert sys.modules[old] is module


def test_bmtrains_imports_as_scripts_write_them() -> None:
    from bmt_wrap.block_layer import CheckpointBlock
    from bmt_wrap.checkpoint.formats import open_source
    from bmt_wrap.nn.linear import Linear
    from bmt_wrap.store import load, save

    assert (save, load) == (bmt.save, bmt.load) and CheckpointBlock is bmt.CheckpointBlock
    assert Linear is bmt.nn.Linear and open_source is importlib.import_module("bmt_wrap.save_load.formats").open_source
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
