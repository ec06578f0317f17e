"""Offload files (``offload="disk"``'s shards, ``AdamDiskOptimizer``'s state) leave with their process: removed
at a normal exit, and, when the process was killed, by the next process that makes one in the same place
(only directories of this host whose process is gone)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bmt_wrap.runtime.backing_file import sweep_stale
from bmt_wrap.runtime.offload import ShardFile

_MAKE = r"""
import os, sys, time, torch
from bmt_wrap.runtime.offload import ShardFile
f = ShardFile(sys.argv[1], rank=0)
f.map(f.reserve(1 << 20, torch.float32)).fill_(1.0)  # 4 MiB written
print(f.directory, flush=True)
if sys.argv[2] == "wait":
    time.sleep(600)
"""


def _start(tmp: Path, mode: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", _MAKE, str(tmp), mode], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_a_normal_exit_removes_the_files(tmp_path: Path) -> None:
    proc, directory = _start(tmp_path, "exit")
    assert proc.wait(timeout=120) == 0
    assert directory and not os.path.exists(directory), f"{directory} outlived its process"


def test_a_killed_process_files_are_removed_by_the_next_one(tmp_path: Path) -> None:
    killed, stale = _start(tmp_path, "wait")
    alive, running = _start(tmp_path, "wait")
    try:
        assert os.path.isfile(os.path.join(stale, "shards.bin"))
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=60)
        assert os.path.isdir(stale), "SIGKILL leaves the directory (nothing can run at exit)"
        foreign = tmp_path / "bmt_offload_rank0_pid1@some-other-host.abc123"  # another host's job: never touched
        foreign.mkdir()
        with pytest.warns(UserWarning, match=r"removed offload files .*" + os.path.basename(stale) + r" \([0-9.]+ MiB\)"):
            fresh = ShardFile(tmp_path, rank=1)
        assert not os.path.exists(stale), "the killed process's files are removed"
        assert os.path.isdir(running), "a live process keeps its files"
        assert foreign.is_dir(), "another host's files are left alone"
        assert os.path.isdir(fresh.directory)
        assert sweep_stale(tmp_path) == [], "nothing else is stale"
        fresh.close()
    finally:
        alive.kill()
        alive.wait(timeout=60)


def test_a_killed_process_reports_its_size(tmp_path: Path) -> None:
    killed, stale = _start(tmp_path, "wait")
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait(timeout=60)
    with pytest.warns(UserWarning):
        removed = sweep_stale(tmp_path)
    assert [path for path, _ in removed] == [stale]
    assert removed[0][1] >= 4 << 20, "the 4 MiB written are counted"
