"""The benchmark harness's arithmetic (on synthetic results) and gpu.py's behaviour without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.append(str(BENCHMARKS))

from harness import summarize  # noqa: E402
from report import format_table  # noqa: E402


def _rank(system: str, rank: int, times: list[float], rss: int, comm: float | None = None,
          plan: int | None = None) -> dict:
    return {"system": system, "rank": rank, "times": times, "losses": [2.0, 1.5], "rss": rss,
            "comm_bytes": comm, "plan_comm_bytes": plan, "params": 1000, "param_bytes": 4000}


def test_summary_takes_the_slowest_rank_per_step_and_ratios_to_fsdp2() -> None:
    runs = {
        "fsdp2": [[_rank("fsdp2", 0, [1.0, 2.0, 3.0], 100), _rank("fsdp2", 1, [1.5, 1.0, 3.0], 120)]],
        "bmt_wrapper": [[_rank("bmt_wrapper", 0, [0.5, 0.6, 0.7], 90, comm=5700.0, plan=5700),
                         _rank("bmt_wrapper", 1, [0.4, 0.9, 0.1], 80, comm=5700.0, plan=5700)]],
    }
    rows = {r["system"]: r for r in summarize(runs, world_size=2)}
    assert rows["fsdp2"]["median_s"] == 2.0  # per step max over ranks: 1.5, 2.0, 3.0
    assert (rows["fsdp2"]["min_s"], rows["fsdp2"]["max_s"]) == (1.5, 3.0)
    assert rows["bmt_wrapper"]["median_s"] == 0.7  # 0.5, 0.9, 0.7
    assert rows["bmt_wrapper"]["time_vs_fsdp2"] == pytest.approx(0.35)
    assert rows["bmt_wrapper"]["rss_vs_fsdp2"] == pytest.approx(90 / 120)
    assert rows["bmt_wrapper"]["zero3_bound"] == 6000  # 3 x 4000 bytes x (2-1)/2
    assert rows["bmt_wrapper"]["comm_vs_bound"] == pytest.approx(0.95)
    assert rows["bmt_wrapper"]["comm_vs_plan"] == pytest.approx(1.0)
    assert rows["fsdp2"]["comm_bytes"] is None and rows["fsdp2"]["max_loss_diff_vs_single"] is None
    setup = {"describe": "m", "params": 1000, "world_size": 2, "batch_per_rank": 1, "seq": 8, "steps": 3,
             "rounds": 1, "warmup": 1, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "unset", "command": "x"}
    table = format_table(list(rows.values()), setup).splitlines()
    header = next(line for line in table if line.startswith("| system"))
    body = [line for line in table if line.startswith("| bmt_wrapper")]
    assert len(body) == 1 and body[0].count("|") == header.count("|"), "one cell per column"
    assert "0.35x" in body[0] and "0.95x" in body[0]


def _gpu_main(monkeypatch: pytest.MonkeyPatch, *args: str) -> None:
    """benchmarks/gpu.py's ``main`` as ``python benchmarks/gpu.py ARGS`` calls it, in this process."""
    import gpu

    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / "gpu.py"), *args])
    gpu.main()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where no GPU exists")
def test_gpu_benchmark_exits_with_a_message_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit) as exited:  # a message as the code: exit status 1, the message on stderr
        _gpu_main(monkeypatch)
    assert isinstance(exited.value.code, str), exited.value.code
    assert "needs a CUDA GPU" in exited.value.code and "nothing was measured" in exited.value.code


def test_gpu_offload_section_dry_runs_without_a_gpu(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 37's GPU section: its options parse beside gpu.py's, and its sizes count a Llama-shaped model."""
    _gpu_main(monkeypatch, "--dry-run", "--hidden", "1024", "--start", "2", "--max-layers", "8")
    out = capsys.readouterr().out
    sizes = [line for line in out.splitlines() if " layers: " in line]
    counts = [float(line.split(": ")[1].split("B")[0]) for line in sizes]
    assert [line.split(" ")[0] for line in sizes] == ["2", "5", "8"] and counts == sorted(counts) and counts[0] > 0
    assert "bmt_offload_host from 2 layers up to 8" in out and "fsdp2_offload" in out


def test_sharded_formats_benchmark_writes_its_table(tmp_path: Path) -> None:
    out = tmp_path / "formats.md"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(BENCHMARKS / "sharded_formats.py"), "--gb", "0.01", "--width", "256", "--repeats", "1", "--dir",
                           str(tmp_path / "ckpt"), "--out", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=BENCHMARKS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "format" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["bmt.save_checkpoint (ours)", "torch.distributed.checkpoint"]
    assert "command: torchrun --nproc_per_node=2 benchmarks/sharded_formats.py" in out.read_text()


def test_param_ops_benchmark_writes_its_table(tmp_path: Path) -> None:
    out = tmp_path / "param_ops.md"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "param_ops.py"), "--layers", "2", "--width", "32",
                           "--rounds", "1", "--out", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=BENCHMARKS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "operation" not in line]
    assert len(rows) == 5 and all(r.rstrip(" |").endswith("x") for r in rows), rows
    assert "command: python benchmarks/param_ops.py" in out.read_text()


def test_muon_step_benchmark_writes_its_table(tmp_path: Path) -> None:
    out = tmp_path / "muon_step.md"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(BENCHMARKS / "muon_step.py"), "--d-model", "32", "--layers", "2", "--rounds", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=BENCHMARKS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "route" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["unsharded", "sharded, fast path", "gather everything"]
    moved = {r.split("|")[1].strip(): float(r.split("|")[5]) for r in rows}
    assert moved["sharded, fast path"] <= 1.0, "at most 4·S/W bytes per rank"
    assert "command: torchrun --nproc_per_node=2 benchmarks/muon_step.py" in out.read_text()


def test_phase_peaks_benchmark_writes_its_table(tmp_path: Path) -> None:
    out = tmp_path / "phase_peaks.md"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "phase_peaks.py"), "--models", "gpt:2", "--steps", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=BENCHMARKS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = out.read_text()
    (row,) = [line for line in text.splitlines() if line.startswith("| gpt")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    start, phases, peak = float(cells[2]), [float(c) for c in cells[3:7]], float(cells[7])
    assert peak == max(phases) and all(p >= start for p in phases), row  # each phase peaks above the step's start
    assert "MALLOC_MMAP_THRESHOLD_=65536" in text and "command: python benchmarks/phase_peaks.py" in text


def test_results_md_holds_only_tables_a_script_wrote(tmp_path: Path) -> None:
    from assemble_results import assemble, tables_outside_markers

    doc = (BENCHMARKS / "RESULTS.md").read_text()
    assert tables_outside_markers(doc) == [], "every table in RESULTS.md comes from a script's file"
    for block in doc.split("<!-- table: ")[1:]:
        body = block.split("<!-- end table -->")[0].strip().splitlines()[1:]
        assert not body or body[-1].startswith("command: "), f"a table without the command that made it: {block[:60]}"
    (tmp_path / "comm.md").write_text("| op | x |\n|---|---|\n| a | 1 |\n\ncommand: torchrun bench\n")
    new, replaced, _ = assemble("x\n<!-- table: comm.md -->\nold\n<!-- end table -->\ny\n", tmp_path)
    assert replaced == ["comm.md"]
    assert new == "x\n<!-- table: comm.md -->\n| op | x |\n|---|---|\n| a | 1 |\n\ncommand: torchrun bench\n<!-- end table -->\ny\n"


def test_mesh3d_benchmark_writes_its_table_with_counted_bytes_equal_to_the_plan(tmp_path: Path) -> None:
    # 4 ranks as 2 replicas x shards of 1 x TP 2 (the script asserts every rank's bytes equal its plan's)
    out = tmp_path / "mesh3d.md"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                           str(BENCHMARKS / "mesh3d.py"), "--shard-size", "1", "--steps", "1", "--warmup", "1",
                           "--rounds", "1", "--batch", "1", "--seq", "8", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=BENCHMARKS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = out.read_text()
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| HSDP") or line.startswith("| TP")]
    axes = [(r[0].strip(), r[1].split()[0]) for r in rows if len(r) == 6]
    assert axes == [("TP 2 x DP 2 (ZeRO-3 over 2)", a) for a in ("dp", "tp", "world")] + [
        ("HSDP 2 x 1 x TP 2", a) for a in ("replicate", "shard", "tp", "world")]
    assert all(r[5].strip() in ("1.00x", "-") for r in rows if len(r) == 6)
    assert "command: torchrun --nproc_per_node=4 benchmarks/mesh3d.py" in text


def test_context_benchmark_writes_its_table(tmp_path: Path) -> None:
    # smoke sizes: two 64-token steps per job, the search capped at its first step
    out = tmp_path / "context.md"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "context.py"), "--size", "smoke", "--seq", "64",
                           "--step", "64", "--max-seq", "64", "--memory", "8GiB", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=BENCHMARKS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| ")][1:]
    assert [r[0].strip() for r in rows] == [
        "step peak per rank at 64 tokens", "longest sequence that trains (measured; jobs)",
        "the plan's answer (plan --memory --grow-seq 64)", "plan - measured, in steps"]
    assert rows[1][1].strip() == rows[1][2].strip() == "64 (the cap) (1)"  # both fit 8 GiB at the cap
    assert int(rows[2][1]) >= 64 and int(rows[2][2]) >= 64
    assert "command:" in out.read_text()


def test_pipeline_replay_gives_the_bubble_and_lets_a_weights_pass_wait() -> None:
    from pipeline_replay import replay

    # 1F1B over 2 ranks and 2 micro-batches (torch's order), backward twice a forward: (P-1)/(M+P-1) idle each.
    order = {0: [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)],
             1: [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1)]}
    seconds = {a: 1.0 if a[0] == "F" else 2.0 for actions in order.values() for a in actions}
    assert replay(order, seconds) == pytest.approx({0: 1 / 3, 1: 1 / 3})
    # Split backward: stage 0's inputs' part (I) waits for stage 1's I, not its weights' part (W): the span is
    # F, F, I, I, W = 5 (6 if it waited for W), each rank busy 3.
    split = {r: [("F", r, 0), ("I", r, 0), ("W", r, 0)] for r in (0, 1)}
    assert replay(split, dict.fromkeys([a for acts in split.values() for a in acts], 1.0)) == pytest.approx(
        {0: 0.4, 1: 0.4})
    with pytest.raises(ValueError, match="deadlocks"):  # the last stage's backward before its forward
        replay({0: [("F", 0, 0), ("B", 0, 0)], 1: [("B", 1, 0), ("F", 1, 0)]}, seconds | {("B", 1, 0): 1.0})
    with pytest.raises(ValueError, match="no measured time"):
        replay(order, {})
