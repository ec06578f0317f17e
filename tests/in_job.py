"""Running examples/ scripts inside a torchrun job that a tests/job_*.py script already started, each as
``python examples/<script> ARGS`` runs it (``__main__``, examples/ first on ``sys.path``): the example's
run costs no job start-up of its own (two ranks importing torch, transformers and the tool)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_examples(invocations: str) -> None:
    """Run each ``[script, *args]`` of the JSON list ``invocations`` in turn, in this process, as its own
    process would run it; every rank calls this (the examples' collectives need them all)."""
    sys.path.insert(0, str(EXAMPLES))
    for script, *args in json.loads(invocations):
        saved = sys.argv
        sys.argv = [str(EXAMPLES / script), *args]
        try:
            runpy.run_path(str(EXAMPLES / script), run_name="__main__")
        finally:
            sys.argv = saved
