"""The layering docs/design.md asks for, checked on the real import graph: the plan and the passes load no
runtime, the runtime never imports torch.fx, and the lazy package keeps BMTrain's names."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "bmt_wrap"


def _loaded_after(statement: str) -> list[str]:
    """bmt_wrap modules a fresh interpreter has loaded after ``statement``."""
    code = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith('bmt_wrap'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("statement", ["import bmt_wrap", "import bmt_wrap.plan", "import bmt_wrap.passes",
                                       "from bmt_wrap.passes import build_plan, discover_blocks"])
def test_plan_and_passes_load_no_runtime(statement: str) -> None:
    loaded = _loaded_after(statement)
    assert not [m for m in loaded if m.startswith(("bmt_wrap.runtime", "bmt_wrap.wrapping"))
                or m == "bmt_wrap.wrapper"], loaded


def test_printing_a_plan_loads_no_passes() -> None:
    # The runtime holds plans; showing one must not pull torch.fx's side of the package in.
    loaded = _loaded_after("from bmt_wrap.plan import WrapPlan\nprint(WrapPlan(groups=[]), repr(WrapPlan(groups=[])))")
    assert not [m for m in loaded if m.startswith(("bmt_wrap.passes", "bmt_wrap.runtime"))], loaded


def test_runtime_never_imports_torch_fx() -> None:
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.joinpath("runtime").rglob("*.py")
                 if "torch.fx" in p.read_text() or "import fx" in p.read_text()]
    assert not offenders, offenders


# What runtime/ and passes/ may import from the package: base/ (the plan and prefetch schedule one side
# produces and the other executes, dtypes, the torch shims) and the error types. What joins them
# (distributed state, the wrapper) sits above both.
BASE = ("bmt_wrap.base", "bmt_wrap.errors")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_imports() -> dict[str, set[str]]:
    """Each bmt_wrap module's imports of other bmt_wrap modules, every one counted: module level, inside
    functions and under ``if TYPE_CHECKING:`` (a type-only import still ties the two modules together)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                # ``from pkg import mod`` imports the submodule; ``from mod import name`` the module.
                found |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _reaching_out(layer: str, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    """Each module of ``layer``'s imports outside ``layer`` and ``allowed``."""
    allowed = (layer, *allowed)
    out = {m: sorted(t for t in targets if not any(t == a or t.startswith(a + ".") for a in allowed))
           for m, targets in _package_imports().items() if m == layer or m.startswith(layer + ".")}
    return {m: t for m, t in out.items() if t}


def test_runtime_imports_nothing_above_it() -> None:
    # The runtime is handed its communicator (init_distributed installs the engine); it never reaches up.
    assert not _reaching_out("bmt_wrap.runtime", BASE)


def test_passes_import_neither_runtime_nor_anything_above() -> None:
    # The passes produce a plan in one process; what runs it (runtime/) and what joins the two never load.
    assert not _reaching_out("bmt_wrap.passes", BASE)


def test_wrapping_never_imports_the_explicit_api() -> None:
    # The explicit API stands on wrapping/ (state dicts, compile, consistency, the block binding both share,
    # wrapping/bound_block.py); an import back up would tie the two layers into one.
    climbing = {m: [t for t in targets if t == "bmt_wrap.explicit" or t.startswith("bmt_wrap.explicit.")]
                for m, targets in _package_imports().items() if m.startswith("bmt_wrap.wrapping")}
    assert not {m: t for m, t in climbing.items() if t}


def test_base_imports_only_errors() -> None:
    # base/ is what both sides share, so it reaches nothing above it.
    assert not _reaching_out("bmt_wrap.base", ("bmt_wrap.errors",))


def test_log_imports_nothing_from_the_package() -> None:
    # Everything logs, so the logger sits below everything: the rank is handed in (log.set_rank_source).
    assert not _package_imports()["bmt_wrap.base.log"]


def test_package_has_no_import_cycles() -> None:
    graph = _package_imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(t):] + [m, t]))
            if t not in state:
                visit(t, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_lazy_package_keeps_bmtrains_names() -> None:
    # Loading a submodule first must not replace the function of that name (gathered, synchronize).
    code = ("import bmt_wrap.synchronize, bmt_wrap.gathered, bmt_wrap.collectives, bmt_wrap.generate\n"
            "import bmt_wrap as bmt\n"
            "for f in (bmt.synchronize, bmt.gathered):\n"
            "    assert callable(f) and not isinstance(f, type(bmt)), f\n"
            "assert bmt.distributed.all_gather is bmt_wrap.collectives.all_gather\n"
            "assert bmt.nn.Linear and bmt.optim.AdamOptimizer and bmt.BMTrainModelWrapper is bmt.wrap\n"
            "from bmt_wrap import DistributedParameter, init_distributed\n"
            "assert set(bmt.__all__) <= set(dir(bmt))\n"
            "missing = [n for n in bmt.__all__ if getattr(bmt, n, None) is None]\n"
            "assert not missing, missing\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        import bmt_wrap

        bmt_wrap.not_a_name  # noqa: B018
