"""The package's old module paths, each the very module at its new home (docs/design.md, "The map").

BMTrain code imports ``bmtrain.store``, ``bmtrain.nccl``, ``bmtrain.nn`` ...; our own users import
``bmt_wrap.plan``, ``bmt_wrap.checkpoint``, ``bmt_wrap.distributed``. Those paths name the modules that
now live in ``bmtrain/``, ``base/``, ``wrapping/`` ... A meta-path finder answers an old path with the new
module itself (not a copy: one class object, one ``_STATE``), loading it only when first imported, so
``import bmt_wrap.plan`` still loads no runtime.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

# Old path -> new path. A package's submodules follow it (``bmt_wrap.nn.linear``).
MOVED = {
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
    "bmt_wrap.pipe_layer": "bmt_wrap.bmtrain.pipe_layer",
    "bmt_wrap.store": "bmt_wrap.bmtrain.store",
    "bmt_wrap.synchronize": "bmt_wrap.bmtrain.synchronize",
    "bmt_wrap.utils": "bmt_wrap.bmtrain.utils",
    "bmt_wrap.checkpoint": "bmt_wrap.save_load",
    "bmt_wrap.runtime.block_function": "bmt_wrap.runtime.block_executor",
    "bmt_wrap.runtime.process_engine": "bmt_wrap.runtime.active_engine",
    # ``bmt_wrap.passes.rewrite`` is the function ``rewrite`` (the package re-exports it), so that name
    # cannot also be the module now at ``passes.schedule_graph``.
}


def new_path(name: str) -> str | None:
    """Where the module once imported as ``name`` lives now; None if it did not move."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return None


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path as the module at its new one."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        """A spec for an old path (ahead of the path finder, which would load a package's file twice)."""
        new = new_path(fullname)
        return None if new is None else importlib.machinery.ModuleSpec(fullname, self, loader_state=new)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        """The module at the new path, imported there if it was not yet."""
        module = importlib.import_module(spec.loader_state)
        spec.loader_state = module.__spec__  # the import system now sets the alias's spec on it
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: give the module back its own spec (its ``__name__`` and file never change)."""
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths())
