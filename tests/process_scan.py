"""Which tests start a process, read from their code: the `process` marker that `make test-fast` leaves out.

A test starts processes if its function, its fixtures or anything of this repository they reach (module
globals, names imported inside a function, nested functions and lambdas, defaults, closures, methods of
classes, the contents of module-level containers) references a process starter: the subprocess and
multiprocessing modules and what they define, torch's multiprocessing and launchers, os.fork and its
kin. ``dist_harness.run_distributed`` needs no entry: it is found through its ``multiprocessing`` use.
Code outside the repository (torch, transformers) is not read; the fast tier's guard (``forbid_processes``)
catches what it starts.
"""

from __future__ import annotations

import dis
import functools
import importlib
import importlib.util
import multiprocessing.process
import os
import platform
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBID_PROCESSES_ENV = "BMT_TESTS_FORBID_PROCESSES"

STARTER_MODULES = ("subprocess", "multiprocessing", "concurrent.futures.process", "pty", "asyncio.subprocess",
                   "torch.multiprocessing", "torch.distributed.run", "torch.distributed.launch",
                   "torch.distributed.launcher", "torch.distributed.elastic")
# os's starters report their module as "posix", so they are known by identity.
_OS_STARTERS = {id(getattr(os, name)) for name in ("fork", "forkpty", "system", "popen", "posix_spawn",
                                                     "posix_spawnp", "spawnl", "spawnle", "spawnlp", "spawnlpe",
                                                     "spawnv", "spawnve", "spawnvp", "spawnvpe")
                if hasattr(os, name)}
# Modules whose first import on a fresh machine starts a helper to build a cache on disk: matplotlib runs
# fc-list for its font cache (lightning reaches it through torchmetrics). ``warm_import_helpers`` imports
# them before the guard goes on, so that start is the machine's set-up, not a test's.
IMPORT_HELPERS = ("matplotlib.font_manager",)
_CONTAINERS = (list, tuple, set, frozenset)
_CACHE_WRAPPER = type(functools.cache(lambda: None))


def _is_starter_module_name(name: str) -> bool:
    """Whether a dotted module name is, or lies inside, a module whose job is starting processes."""
    return any(name == m or name.startswith(m + ".") for m in STARTER_MODULES)


def _is_starter(obj: Any) -> bool:
    """Whether ``obj`` itself starts processes (a starter module, or a function or class defined in one)."""
    if isinstance(obj, types.ModuleType):
        return _is_starter_module_name(obj.__name__)
    if id(obj) in _OS_STARTERS:
        return True
    if isinstance(obj, types.FunctionType) and hasattr(obj, "__wrapped__"):
        # A wrapper in a starter's place (the fast tier's guard puts some in os) stands for that starter.
        return _is_starter(obj.__wrapped__)
    if callable(obj):
        module = getattr(obj, "__module__", None)
        return isinstance(module, str) and _is_starter_module_name(module)
    return False


@functools.cache
def _in_repository(filename: str) -> bool:
    """Whether a source file is this repository's own code, not an installed package (the venv is inside)."""
    if filename.startswith("<"):  # code made at run time ("<string>", "<frozen ...>") has no file to own
        return False
    path = Path(filename).resolve()
    return (path.is_relative_to(ROOT) and not path.is_relative_to(Path(sys.prefix).resolve())
            and "site-packages" not in path.parts)


def _module_is_ours(module: types.ModuleType) -> bool:
    """Whether a module's file is in this repository."""
    filename = getattr(module, "__file__", None)
    return isinstance(filename, str) and _in_repository(filename)


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and every function, lambda and comprehension nested in it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _imports(code: types.CodeType, package: str | None) -> Iterator[str]:
    """The absolute names of the modules ``code`` imports (``from .x import y`` resolved against ``package``)."""
    instructions = list(dis.get_instructions(code))
    for i, ins in enumerate(instructions):
        if ins.opname != "IMPORT_NAME":
            continue
        # The compiler pushes the level, then the from-list, right before IMPORT_NAME.
        level = instructions[i - 2].argval if i >= 2 and instructions[i - 2].opname == "LOAD_CONST" else 0
        if not level:
            yield ins.argval
        elif package:
            yield importlib.util.resolve_name("." * level + ins.argval, package)


def _imported_module(name: str) -> types.ModuleType | None:
    """The module a function imports by ``name``, if loaded or this repository's own (imported here then)."""
    if name in sys.modules:
        return sys.modules[name]
    # Importing a third-party module only to read it would slow collection; ours are cheap and needed.
    spec = importlib.util.find_spec(name.partition(".")[0])
    if spec is None or spec.origin is None or not _in_repository(spec.origin):
        return None
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - some tests check that an import fails; such a module has no code to read
        return None


def _module_members(module: types.ModuleType, names: set[str]) -> Iterator[Any]:
    """What ``module.<name>`` chains over ``names`` reach, read without triggering lazy imports.

    Bytecode names do not say which attribute follows which object, so any of the function's names is
    tried on the module, and on the modules found that way: over-marking only shrinks the fast tier.
    Of another package's module only starters count: its data (``sys.modules``, ``os.environ``) would
    lead everywhere, and its code is not read anyway.
    """
    todo, seen = [module], {id(module)}
    while todo:
        current = todo.pop()
        ours = _module_is_ours(current)
        members = vars(current)
        for name in names:
            value = members.get(name)
            if value is None:
                continue
            if isinstance(value, types.ModuleType):
                if id(value) not in seen:
                    seen.add(id(value))
                    todo.append(value)
                    yield value
            elif ours or _is_starter(value):
                yield value


def _function_refs(fn: types.FunctionType) -> Iterator[Any]:
    """Everything a function's code can reach by name: globals, locally imported modules and their members."""
    names: set[str] = set()
    imports: set[str] = set()
    for code in _codes(fn.__code__):
        names.update(code.co_names)
        imports.update(_imports(code, fn.__globals__.get("__package__")))
    modules = []
    for name in imports:
        if _is_starter_module_name(name):
            # A bare module of that name stands for the starter without importing it.
            yield sys.modules.get(name) or types.ModuleType(name)
            continue
        module = _imported_module(name)
        if module is not None:
            modules.append(module)
    for name in names:
        if name in fn.__globals__:
            value = fn.__globals__[name]
            if isinstance(value, types.ModuleType):
                modules.append(value)
            yield value
    for module in modules:
        yield module
        yield from _module_members(module, names)


def _children(obj: Any) -> Iterator[Any]:
    """The objects whose process starts count as ``obj``'s."""
    if isinstance(obj, types.FunctionType | _CACHE_WRAPPER):
        # Decorators hide the code: functools.wraps and functools.cache leave __wrapped__, hypothesis
        # leaves inner_test.
        yield from (x for x in (getattr(obj, "__wrapped__", None),
                                getattr(getattr(obj, "hypothesis", None), "inner_test", None)) if x is not None)
        if isinstance(obj, _CACHE_WRAPPER) or not _in_repository(obj.__code__.co_filename):
            return
        yield from _function_refs(obj)
        yield from obj.__defaults__ or ()
        yield from (obj.__kwdefaults__ or {}).values()
        for cell in obj.__closure__ or ():
            try:
                yield cell.cell_contents
            except ValueError:  # a cell not yet filled (a name bound later in the enclosing function)
                pass
    elif isinstance(obj, types.MethodType | staticmethod | classmethod):
        yield obj.__func__
    elif isinstance(obj, property):
        yield from (f for f in (obj.fget, obj.fset, obj.fdel) if f is not None)
    elif isinstance(obj, functools.partial):
        yield obj.func
        yield from obj.args
        yield from obj.keywords.values()
    elif isinstance(obj, type):
        module = sys.modules.get(obj.__module__)
        if module is not None and _module_is_ours(module):
            yield from vars(obj).values()
            yield from obj.__bases__
    elif isinstance(obj, dict):
        yield from obj.keys()
        yield from obj.values()
    elif isinstance(obj, _CONTAINERS):
        yield from obj
    elif not isinstance(obj, types.ModuleType | str | bytes | int | float | complex | bool):
        # An instance of one of our classes (a case table's entry) runs that class's methods and holds
        # what they may call.
        yield type(obj)
        module = sys.modules.get(type(obj).__module__)
        if module is not None and _module_is_ours(module):
            yield from getattr(obj, "__dict__", {}).values()


class ProcessScan:
    """Answers "does this reach a process starter?", remembering what it learnt for the next test."""

    def __init__(self) -> None:
        # id -> object; the objects are held so that their ids are never reused.
        self._clean: dict[int, Any] = {}
        self._starting: dict[int, Any] = {}
        # id -> (object, its children): a function reached by many tests is disassembled once, not per test.
        self._children: dict[int, tuple[Any, list[Any]]] = {}

    def starts_process(self, *roots: Any) -> bool:
        """Whether any of ``roots`` (test functions, fixture functions, parameter values) reaches a starter."""
        seen: dict[int, Any] = {}
        parent: dict[int, int | None] = {}
        stack: list[tuple[Any, int | None]] = [(root, None) for root in roots]
        while stack:
            obj, via = stack.pop()
            key = id(obj)
            if key in self._starting:
                self._remember_path(via, seen, parent)
                return True
            if key in seen or key in self._clean:
                continue
            seen[key], parent[key] = obj, via
            if _is_starter(obj):
                self._remember_path(key, seen, parent)
                return True
            if key not in self._children:
                self._children[key] = (obj, list(_children(obj)))
            stack.extend((child, key) for child in self._children[key][1])
        # A search that ended without a starter read all that it reached, so each of those is clean.
        self._clean.update(seen)
        return False

    def _remember_path(self, key: int | None, seen: dict[int, Any], parent: dict[int, int | None]) -> None:
        """Record that every object on the path from a root to ``key`` reaches a starter."""
        while key is not None:
            self._starting[key] = seen[key]
            key = parent[key]


def item_roots(item: pytest.Function) -> list[Any]:
    """What decides whether ``item`` starts a process: its function, its fixtures' and its parameters."""
    # pytest has no public accessor for the fixture functions an item will run.
    defs = item._fixtureinfo.name2fixturedefs
    fixtures = [d.func for name in item.fixturenames for d in defs.get(name, ())]
    params = list(item.callspec.params.values()) if hasattr(item, "callspec") else []
    return [item.function, *fixtures, *params]


def _refuse(what: str, original: Callable[..., Any]) -> Callable[..., NoReturn]:
    """A stand-in for ``original`` that fails the test calling it."""
    # wraps() leaves __wrapped__, by which the scan, collecting after the patch, still sees the starter.
    @functools.wraps(original)
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(f"{what} started a process under {FORBID_PROCESSES_ENV}=1, which `make test-fast` "
                           "sets for the tests that tests/process_scan.py found to start none: teach the scan "
                           "what it missed, or mark this test @pytest.mark.process; if a library's first "
                           "import started it to build a cache, add that module to process_scan.IMPORT_HELPERS")
    return refuse


def forbid_processes(patch: pytest.MonkeyPatch) -> None:
    """Make every way of starting a process from Python raise, until ``patch`` is undone."""
    # The lowest Python-level doors each starter goes through, whatever name its caller imported it by.
    doors = [(subprocess.Popen, "_execute_child", "subprocess"),
             (multiprocessing.process.BaseProcess, "start", "multiprocessing")]
    doors += [(os, name, f"os.{name}") for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")
              if hasattr(os, name)]
    for owner, name, what in doors:
        patch.setattr(owner, name, _refuse(what, getattr(owner, name)))


def warm_import_helpers() -> None:
    """Import the installed ``IMPORT_HELPERS``, letting each build its cache now (call before the guard)."""
    for name in IMPORT_HELPERS:
        if importlib.util.find_spec(name.partition(".")[0]) is not None:
            importlib.import_module(name)
    # pytest-xdist's worker reports platform.platform(), whose first call runs `uname -p` and caches its answer.
    platform.platform()
