"""Count jobs that finish their work and still fail at exit: RUNS torchrun jobs under CPU load (issue 22).

Usage: ``nice -n 10 python tools/exit_soak.py [--runs 60] [--nproc 2] [--busy 2]
[--kinds plain,save,unsharded] [--cores DIR] [--out FILE]``. Each run is ``torchrun --standalone
--nproc-per-node NPROC tests/exit_jobs.py rank KIND`` (the user scripts of tests/exit_jobs.py, taken in
turn, none calling ``bmt.shutdown()``) while BUSY processes spin on the CPU. A run fails when torchrun
does or a rank prints ``terminate called``. Prints a line per failed run and a summary, and writes every
run's record to ``--out`` (JSON). ``--cores DIR`` runs the ranks there with core dumps allowed (for
``gdb python core``).

The bmt_wrap measured is the one ``import bmt_wrap`` finds from a directory outside the checkout, so
``PYTHONPATH=/some/older/copy`` measures another version with the same scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, os.pardir, "tests", "exit_jobs.py")
KINDS = ("plain", "save", "unsharded")


def _allow_cores() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def run_job(kind: str, nproc: int, workdir: str, cores: bool, limit_s: float) -> dict:
    """One torchrun job of ``kind``: its return code, seconds, and the tail of its output if it failed."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}", os.path.abspath(SCRIPT), "rank", kind]
    start = time.monotonic()
    try:
        out = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=limit_s,
                             preexec_fn=_allow_cores if cores else None)
        rc, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as exc:
        rc, text = None, f"timed out after {limit_s} s\n{exc.stderr or ''}"
    record = {"kind": kind, "rc": rc, "seconds": round(time.monotonic() - start, 1),
              "terminate": "terminate called" in text}
    if rc != 0 or record["terminate"]:
        record["output"] = text[-4000:]
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--busy", type=int, default=2, help="processes spinning on the CPU meanwhile")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--cores", help="directory the ranks run in and dump core to")
    parser.add_argument("--limit", type=float, default=900.0, help="seconds before a job counts as hung")
    parser.add_argument("--out", default="exit_soak.json")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    if set(kinds) - set(KINDS):
        parser.error(f"--kinds takes {','.join(KINDS)}")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    records = []
    scratch = tempfile.TemporaryDirectory(prefix="bmt_soak_")
    try:
        for i in range(args.runs):
            kind = kinds[i % len(kinds)]
            workdir = os.path.join(args.cores or scratch.name, f"{i}-{kind}")
            os.makedirs(workdir, exist_ok=True)
            record = run_job(kind, args.nproc, workdir, bool(args.cores), args.limit)
            records.append(record)
            if record["rc"] != 0 or record["terminate"]:
                print(f"run {i} ({kind}): rc={record['rc']} terminate={record['terminate']}", flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
        scratch.cleanup()
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    failed = [r for r in records if r["rc"] != 0 or r["terminate"]]
    per_kind = {k: f"{sum(1 for r in failed if r['kind'] == k)}/{sum(1 for r in records if r['kind'] == k)}"
                for k in kinds}
    mean_s = sum(r["seconds"] for r in records) / max(len(records), 1)
    print(f"{len(failed)} of {len(records)} runs failed at or before exit ({args.nproc} ranks, {args.busy} busy "
          f"processes; per kind {per_kind}); mean {mean_s:.0f} s per run; record in {args.out}")


if __name__ == "__main__":
    main()
