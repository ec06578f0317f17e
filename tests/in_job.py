"""Running examples/ scripts one after another in one torchrun job, each as ``python examples/<script> ARGS``
runs it (``__main__``, examples/ first on ``sys.path``): an example run costs no job start-up of its own
(two ranks importing torch and the libraries). tests/job_*.py call ``run_examples`` after their own runs;
``torchrun tests/in_job.py EXAMPLES`` runs the examples alone. Rank 0 prints ``MARK + script`` before each,
so ``sections`` can tell their outputs apart."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MARK = "==> examples/"


def run_examples(invocations: str) -> None:
    """Run each ``[script, *args]`` of the JSON list ``invocations`` in turn, in this process, as its own
    process would run it; every rank calls this (the examples' collectives need them all)."""
    sys.path.insert(0, str(EXAMPLES))
    for script, *args in json.loads(invocations):
        if os.environ.get("RANK", "0") == "0":
            print(MARK + script, flush=True)  # flushes the previous example's output before it
        saved = sys.argv
        sys.argv = [str(EXAMPLES / script), *args]
        try:
            runpy.run_path(str(EXAMPLES / script), run_name="__main__")
        finally:
            sys.argv = saved
    sys.stdout.flush()


def sections(output: str) -> dict[str, str]:
    """Rank 0's output of each example in ``output`` (a job's stdout), by script name."""
    parts = ("\n" + output).split("\n" + MARK)
    return {part.split("\n", 1)[0]: part.partition("\n")[2] for part in parts[1:]}


if __name__ == "__main__":
    run_examples(sys.argv[1])
