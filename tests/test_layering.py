"""The layering DESIGN.md asks for, checked on the real import graph: the plan and the passes load no
runtime, the runtime never imports torch.fx, and the lazy package keeps BMTrain's names."""

from __future__ import annotations

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
    assert not [m for m in loaded if m.startswith("bmt_wrap.runtime") or m == "bmt_wrap.wrapper"], loaded


def test_runtime_never_imports_torch_fx() -> None:
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.joinpath("runtime").rglob("*.py")
                 if "torch.fx" in p.read_text() or "import fx" in p.read_text()]
    assert not offenders, offenders


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
