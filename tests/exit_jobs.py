"""Run small N-rank training jobs to completion and report how each process exited (issue 12).

Usage: ``python exit_jobs.py WORLD_SIZE RUNS``; prints one JSON line: per run, each rank's exit code
(negative: killed by that signal, -6 is SIGABRT) and whether the default process group was still
alive when the last exit hook ran. Ranks are forked from this process after it imported torch and
warmed up the first-forward capture, so a run costs a fraction of a cold start; each rank still
ends with a real interpreter exit (exit hooks, finalisation, C++ static destructors), where the abort
happens.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from toy import ToyGPT  # noqa: E402

import bmt_wrap as bmt  # noqa: E402
from bmt_wrap import passes  # noqa: E402


def _train() -> None:
    model = bmt.BMTrainModelWrapper(ToyGPT(n_layers=3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.randint(0, 64, (2, 8))
    for _ in range(2):
        model(idx, idx).backward()
        opt.step()
        opt.zero_grad()


def _rank_main(rank: int, world_size: int, port: int, probe: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    def report() -> None:  # registered before init_distributed, so it runs after bmt_wrap's exit hook
        with open(probe, "w") as f:
            f.write("1" if dist.is_initialized() else "0")

    atexit.register(report)
    bmt.init_distributed(seed=0, backend="gloo")
    _train()
    sys.exit(0)  # unwinds to a normal interpreter exit


def main() -> None:
    world_size, runs = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    # Warm up the first-forward capture (the torch.export imports) without a process group: gloo's
    # threads do not survive fork, and a forked rank would abort joining them.
    warm = ToyGPT(n_layers=3)
    idx = torch.zeros(2, 8, dtype=torch.long)
    passes.capture(passes.meta_skeleton(warm), passes.discover_blocks(warm), ((idx, idx), {}))
    tmp = tempfile.mkdtemp(prefix="bmt_exit_")
    report = []
    for run in range(runs):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        pids = []
        for rank in range(world_size):
            probe = os.path.join(tmp, f"{run}-{rank}")
            pid = os.fork()
            if pid == 0:
                _rank_main(rank, world_size, port, probe)
            pids.append((pid, probe))
        codes, left = [], []
        for pid, probe in pids:
            _, status = os.waitpid(pid, 0)
            codes.append(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
            left.append(open(probe).read() == "1" if os.path.exists(probe) else None)
        report.append({"codes": codes, "group_left_at_exit": left})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
