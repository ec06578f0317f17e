"""The three tool jobs of tests/test_integrations.py one after another in one torchrun job: the ranks import
torch, transformers, accelerate and Lightning and join the process group once, not three times.

Usage: ``torchrun --nproc_per_node=2 job_tools.py OUT_DIR EXAMPLES``, EXAMPLES a JSON object {tool: [[script,
*args], ...]}. Each job (job_trainer.py, job_accelerate.py, job_lightning.py; each also runs alone) writes
into ``OUT_DIR/<tool>`` and then runs its tool's examples (tests/in_job.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import job_accelerate
import job_lightning
import job_trainer

JOBS = {"trainer": job_trainer.main, "accelerate": job_accelerate.main, "lightning": job_lightning.main}


def main(out: str, examples: dict[str, list[list[str]]]) -> None:
    for tool, job in JOBS.items():
        Path(out, tool).mkdir(parents=True, exist_ok=True)
        job(f"{out}/{tool}", json.dumps(examples.get(tool, [])))


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
