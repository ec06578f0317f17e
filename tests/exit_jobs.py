"""Run small N-rank user scripts to completion and report how each process exited (issues 12 and 22).

Usage: ``python exit_jobs.py WORLD_SIZE RUNS [KINDS]``, KINDS a comma list of ``plain`` (a model of
``nn.MultiheadAttention`` layers trained with ``torch.optim.AdamW``), ``save`` (the same, then
``bmt.save``), ``unsharded`` (a model with no parameters: nothing to shard) and ``tp`` (``plain`` wrapped
with ``tp_size=2``), taken in turn; the first three by default. None of them calls ``bmt.shutdown()``, and
each keeps its model to the end, as a script's global does. Prints one JSON line: per run, its kind, each
rank's exit code (negative: killed by that signal, -6 is SIGABRT; ``null``: still running after the time
limit and killed), whether the default process group was still alive when the last exit hook ran, which
gloo/bmt_wrap threads were still running then, and the tail of each rank's stderr that is not empty.

``torchrun --nproc-per-node N exit_jobs.py rank KIND`` runs one rank of such a job as a user script
does (tools/exit_soak.py counts aborts that way, under load).

Ranks are forked from this process after it imported torch and bmt_wrap, so a run costs a fraction of a
cold start; each rank still ends with a real interpreter exit (exit hooks, finalisation, C++ static
destructors), where the abort happens. Nothing that the first wrap loads (torch._dynamo,
torch.distributed.nn) is imported before the fork: modules that load while a process group exists are
what a real job has, and what kept issue 22's group alive past the exit hook.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import bmt_wrap as bmt  # noqa: E402

KINDS = ("plain", "save", "unsharded", "tp")
DEFAULT_KINDS = KINDS[:3]
_MODEL: nn.Module | None = None  # the job's model, alive at exit as a script's global is
RUN_LIMIT_S = 240.0  # a rank that hangs at exit is reported (code null), not waited on forever
# Threads that must be gone before the interpreter tears down: gloo's (the process group's workers and
# its transport loop) and ours.
WATCHED_THREADS = ("pt_gloo", "gloo_tcp", "bmt_wrap")


class _Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class _Net(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, n_layers: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_Layer(d) for _ in range(n_layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _train(kind: str, workdir: str) -> nn.Module:
    """Run the job of ``kind``; return its model, which the caller keeps until the interpreter exits."""
    if kind == "unsharded":
        model = bmt.BMTrainModelWrapper(nn.Sequential(nn.LayerNorm(16, elementwise_affine=False), nn.GELU()))
        for _ in range(3):
            x = torch.randn(4, 16, requires_grad=True)
            model(x).square().mean().backward()
            bmt.sum_loss(x.grad.sum())
        return model
    model = bmt.BMTrainModelWrapper(_Net(), tp_size=2 if kind == "tp" else 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        idx = torch.randint(0, 64, (2, 8))
        nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        opt.step()
        opt.zero_grad()
    if kind == "save":
        bmt.save(model, os.path.join(workdir, "model.safetensors"))
    return model


def _live_threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while we looked
            pass
    return sorted(n for n in names if n.startswith(WATCHED_THREADS))


def _rank_main(kind: str, rank: int, world_size: int, port: int, base: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    err = os.open(base + ".err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)  # C++ writes "terminate called ..." to fd 2

    def report() -> None:  # registered before init_distributed, so it runs after bmt_wrap's exit hook
        with open(base + ".probe", "w") as f:
            json.dump({"group": dist.is_initialized(), "threads": _live_threads()}, f)

    atexit.register(report)
    bmt.init_distributed(seed=0, backend="gloo")
    global _MODEL
    _MODEL = _train(kind, os.path.dirname(base))
    sys.exit(0)  # unwinds to a normal interpreter exit


def _wait(pids: list[int], deadline: float) -> list[int | None]:
    codes: dict[int, int | None] = {}
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        time.sleep(0.05)
    for pid in pids:
        if pid not in codes:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            codes[pid] = None
    return [codes[pid] for pid in pids]


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def main() -> None:
    if sys.argv[1] == "rank":  # under torchrun: the user script itself
        bmt.init_distributed(seed=0, backend="gloo")
        global _MODEL
        _MODEL = _train(sys.argv[2], os.getcwd())
        return
    world_size, runs = int(sys.argv[1]), int(sys.argv[2])
    kinds = sys.argv[3].split(",") if len(sys.argv) > 3 else list(DEFAULT_KINDS)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise SystemExit(f"unknown kinds {sorted(unknown)}; use {','.join(KINDS)}")
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="bmt_exit_")
    report = []
    for run in range(runs):
        kind = kinds[run % len(kinds)]
        workdir = os.path.join(tmp, str(run))
        os.makedirs(workdir)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        pids = []
        for rank in range(world_size):
            pid = os.fork()
            if pid == 0:
                _rank_main(kind, rank, world_size, port, os.path.join(workdir, str(rank)))
            pids.append(pid)
        codes = _wait(pids, time.monotonic() + RUN_LIMIT_S)
        probes = []
        for rank in range(world_size):
            text = _read(os.path.join(workdir, f"{rank}.probe"))
            probes.append(json.loads(text) if text else None)
        report.append({
            "kind": kind, "codes": codes,
            "group_left_at_exit": [p["group"] if p else None for p in probes],
            "threads_left_at_exit": [p["threads"] if p else None for p in probes],
            "stderr": {rank: text[-1500:] for rank in range(world_size)
                       if (text := _read(os.path.join(workdir, f"{rank}.err")))},
        })
    shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
