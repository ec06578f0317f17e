"""The ``bmt-wrap`` command: dump and plan on meta models, and one clear line for every user error."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from bmt_wrap.cli import build_parser, main, parse_bytes, parse_input
from bmt_wrap.errors import CLIError
from bmt_wrap.plan import WrapPlan

MODELS = str(Path(__file__).with_name("models.py"))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_dump_json_is_a_reappliable_plan_and_a_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "dump", f"{MODELS}:gpt2", "--world-size", "4", "--format", "json",
                         "--input", "input_ids=int64[2,16]")
    assert code == 0, err
    doc = json.loads(out)
    plan = WrapPlan.from_json(json.dumps(doc["plan"]))
    assert plan.capture == "export" and plan.order == ["transformer.h.0", "transformer.h.1"]
    assert plan.estimates["4"].activations is not None
    kinds = [r["step"]["kind"] for r in doc["graph"] if r["step"]]
    assert kinds.count("prefetch") == kinds.count("wait") == kinds.count("release") == 2


def _wrapped_plan_body() -> dict:
    import models

    import bmt_wrap as bmt

    model = bmt.BMTrainModelWrapper(models.llama_self_checkpointing())
    left_on = [n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False)]
    return {"plan": model.plan.to_json(), "left_on": left_on}


def test_cli_and_wrapper_make_the_same_plan_for_a_self_checkpointing_model(
        capsys: pytest.CaptureFixture[str]) -> None:
    # transformers' gradient checkpointing on: the planner decides to take it over, for both.
    from dist_harness import run_distributed

    code, out, err = run(capsys, "dump", f"{MODELS}:llama_self_checkpointing", "--world-size", "1",
                         "--format", "json")
    assert code == 0, err
    shown = WrapPlan.from_json(json.dumps(json.loads(out)["plan"]))
    result = run_distributed(_wrapped_plan_body, 1)[0]
    applied = WrapPlan.from_json(result["plan"])

    def schedule(p: WrapPlan) -> tuple:
        return ([(g.name, g.checkpoint, g.zero_level) for g in p.groups], p.order, p.prefetch_depth,
                p.self_checkpointing_off)

    assert schedule(shown) == schedule(applied)
    assert all(g.checkpoint for g in shown.blocks()) and shown.self_checkpointing_off
    assert result["left_on"] == [], "wrapping turned transformers' checkpointing off"


def test_dump_text_and_dot(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "dump", f"{MODELS}:ToyGPT")
    assert code == 0 and out.startswith("capture: fx | blocks: 4")
    code, out, _ = run(capsys, "dump", f"{MODELS}:ToyGPT", "--format", "dot", "--prefetch-depth", "2")
    assert code == 0 and out.startswith("digraph") and "prefetch depth: 2" in out


def test_plan_table_has_a_column_per_world_size(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", f"{MODELS}:llama", "--world-size", "1", "8", "--dtype", "bf16",
                       "--memory-budget", "1GiB", "--input", "input_ids=int64[1,32]")
    assert code == 0
    lines = out.splitlines()
    header = next(line for line in lines if line.strip().startswith("per rank"))
    assert header.split()[-2:] == ["N=1", "N=8"]
    assert "(bfloat16)" in lines[0]
    assert next(line for line in lines if "activations" in line).split()[-1] != "n/a"


def test_a_plan_prints_the_tables_dump_shows(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["dump", f"{MODELS}:ToyGPT", "--world-size", "2", "--input", "int64[2,8]"]
    _, printed, _ = run(capsys, *argv)
    _, doc, _ = run(capsys, *argv, "--format", "json")
    shown = str(WrapPlan.from_json(json.dumps(json.loads(doc)["plan"]))).splitlines()
    tables = shown[shown.index("groups:"):]
    assert shown[0] == printed.splitlines()[0] and printed.splitlines()[-len(tables):] == tables


def test_dotted_module_names_import_from_the_current_directory(capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    (tmp_path / "mymodels.py").write_text("import torch\ndef build():\n    return torch.nn.Linear(2, 2)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    code, out, _ = run(capsys, "plan", "mymodels:build", "--world-size", "2")
    assert code == 0 and "6 parameters" in out


@pytest.mark.parametrize("argv,message", [
    (["plan", "no_such_module_xyz:f", "--world-size", "2"], "cannot import 'no_such_module_xyz'"),
    (["plan", f"{MODELS}:nope", "--world-size", "2"], "has no callable 'nope'"),
    (["plan", "missing/file.py:f", "--world-size", "2"], "no such file"),
    (["plan", "just_a_name", "--world-size", "2"], "expected MODULE:FACTORY"),
    (["plan", f"{MODELS}:VOCAB", "--world-size", "2"], "has no callable 'VOCAB'"),
    (["plan", f"{MODELS}:token_ids", "--world-size", "2"], "returned Tensor, not a torch.nn.Module"),
    (["plan", f"{MODELS}:ToyGPT", "--world-size", "2", "--input", "ids=int64(1,2)"], "bad --input"),
    (["plan", f"{MODELS}:ToyGPT", "--world-size", "2", "--input", "ids=complex7[1]"], "unknown dtype"),
    (["plan", f"{MODELS}:ToyGPT", "--world-size", "2", "--input", "a=int64[1]", "--input", "a=int64[2]"],
     "given twice"),
    (["plan", f"{MODELS}:ToyGPT", "--world-size", "2", "--memory-budget", "lots"], "bad --memory-budget"),
    (["plan", f"{MODELS}:ToyGPT", "--world-size", "2", "--dtype", "fp8"], "bad --dtype"),
    (["plan", f"{MODELS}:ToyGPT", "--world-size", "0"], "world_size must be >= 1"),
    (["plan", f"{MODELS}:ToyGPT", "--world-size", "2", "--input", "no_such_arg=float32[2,64]"],
     "--input does not fit ToyGPT.forward(input_ids, targets=None): it has no argument 'no_such_arg'; "),
    (["plan", f"{MODELS}:ToyGPT", "--world-size", "2", "--input", "targets=int64[2,8]"],
     "missing a required argument: 'input_ids'"),
    (["plan", f"{MODELS}:ToyGPT", "--world-size", "2", "--input", "int64[2,8]", "--input", "int64[2,8]",
      "--input", "int64[2,8]"], "too many positional arguments"),
    (["plan", f"{MODELS}:ToyGPT", "--world-size", "2", "--input", "int64[2,8]", "--memory-budget", "1KiB"],
     "--memory-budget 1.00 KiB per rank cannot be met"),
    (["plan", f"{MODELS}:ToyGPT", "--world-size", "2", "--memory-budget", "1KiB"],
     "N=2 needs at least"),
])
def test_errors_are_one_line_without_traceback(capsys: pytest.CaptureFixture[str], argv: list[str],
                                               message: str) -> None:
    code, out, err = run(capsys, *argv)
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("bmt-wrap: error: ")
    assert message in err
    assert "Traceback" not in err


def test_an_input_name_outside_a_typed_kwargs_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # transformers' forwards end in ``**kwargs: Unpack[TransformersKwargs]``: only that TypedDict's keys.
    code, _, err = run(capsys, "plan", f"{MODELS}:llama", "--world-size", "2",
                       "--input", "input_ids=int64[2,8]", "--input", "no_such_arg=float32[2,64]")
    assert code == 2 and "LlamaForCausalLM.forward(input_ids=None, " in err
    assert "it has no argument 'no_such_arg' (its **kwargs take only TransformersKwargs' keys)" in err
    code, _, err = run(capsys, "plan", f"{MODELS}:llama", "--world-size", "2", "--input", "input_ids=int64[2,8]",
                       "--input", "output_hidden_states=bool[]")
    assert code == 0, err


def test_an_unmeetable_budget_names_the_smallest_feasible_one(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", f"{MODELS}:ToyGPT", "--input", "int64[2,16]", "--world-size", "1", "2", "--memory-budget"]
    code, out, err = run(capsys, *argv, "1KiB")
    assert code == 2 and out == ""
    needs = dict(re.findall(r"N=(\d) needs at least [\d.]+ \w+ \((\d+) B\)", err))
    assert set(needs) == {"1", "2"} and int(needs["1"]) > int(needs["2"]), err
    assert err.rstrip().endswith("raise the budget, add ranks, shrink the batch or lower --prefetch-depth")
    code, out, err = run(capsys, *argv, f"{needs['2']} B")
    assert code == 2 and "N=1 needs" in err and "N=2" not in err
    code, out, err = run(capsys, *argv, needs["1"])
    assert code == 0 and "activations" in out, err


def test_a_total_without_activations_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", f"{MODELS}:ToyGPT", "--world-size", "2")
    assert code == 0
    assert [line.split("  ")[1] for line in out.splitlines() if "= total" in line] == \
        ["= total per rank without activations"]
    code, out, _ = run(capsys, "plan", f"{MODELS}:ToyGPT", "--world-size", "2", "--input", "int64[2,8]")
    assert [line.split("  ")[1] for line in out.splitlines() if "= total" in line] == ["= total per rank"]


def test_expected_fallbacks_show_only_with_verbose(capsys: pytest.CaptureFixture[str]) -> None:
    # fx cannot trace transformers models; torch.export then does: nothing the user needs to act on.
    for command in ("plan", "dump"):
        argv = [command, f"{MODELS}:llama", "--world-size", "2", "--input", "input_ids=int64[1,8]"]
        code, out, err = run(capsys, *argv)
        assert code == 0 and "capture: export" in out, err
        assert "fx.symbolic_trace failed" not in out
        code, out, err = run(capsys, *argv, "-v")
        assert code == 0 and "note: schedule: fx.symbolic_trace failed (" in out, err


def test_every_option_of_every_subcommand_has_help() -> None:
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    bare = {name: [a.dest for a in sub._actions if not a.help] for name, sub in commands.choices.items()}
    assert bare == {"dump": [], "plan": []}


def test_factory_raising_is_reported_and_debug_shows_the_traceback(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def build():\n    raise ValueError('config is broken')\n")
    code, _, err = run(capsys, "plan", f"{bad}:build", "--world-size", "2")
    assert code == 2 and err.strip() == \
        f"bmt-wrap: error: factory '{bad}:build' raised ValueError: config is broken"
    code, _, err = run(capsys, "plan", f"{bad}:build", "--world-size", "2", "--debug")
    assert code == 2 and "Traceback" in err and "config is broken" in err.splitlines()[-1]


def test_parsers() -> None:
    name, t = parse_input("input_ids=int64[1, 128]")
    assert name == "input_ids" and t.shape == (1, 128) and t.is_meta and str(t.dtype) == "torch.int64"
    name, t = parse_input("bf16[2,3]")
    assert name is None and t.shape == (2, 3)
    assert parse_input("float32[]")[1].shape == ()
    assert parse_bytes("40GiB") == 40 * 2**30 and parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("512mib") == 512 * 2**20 and parse_bytes("1000") == 1000
    with pytest.raises(CLIError):
        parse_input("input_ids=int64")


README = Path(__file__).resolve().parent.parent / "README.md"


def readme_cli_examples() -> list[tuple[list[str], list[str]]]:
    """Every ``$ bmt-wrap ...`` example in README.md: (arguments, the lines shown after it)."""
    text = README.read_text()
    examples = []
    for block in re.findall(r"```text\n(.*?)```", text, flags=re.S):
        lines = block.rstrip("\n").splitlines()
        if lines and lines[0].startswith("$ bmt-wrap "):
            examples.append((shlex.split(lines[0][len("$ bmt-wrap "):]), lines[1:]))
    return examples


def _shown_in_order(shown: list[str], printed: list[str]) -> str | None:
    """None if ``printed`` contains the ``shown`` lines in order, ``...`` standing for any run of lines;
    else the first shown line that is missing."""
    pos = 0
    for line in shown:
        if line.strip() == "...":
            continue
        while pos < len(printed) and printed[pos] != line:
            pos += 1
        if pos == len(printed):
            return line
        pos += 1
    return None


def test_readme_cli_examples_print_what_the_readme_shows() -> None:
    # The installed console script, from the repository root (the README's paths are relative to it).
    examples = readme_cli_examples()
    assert {argv[0] for argv, _ in examples} == {"dump", "plan"}, examples
    script = Path(sys.executable).with_name("bmt-wrap")
    for argv, shown in examples:
        proc = subprocess.run([str(script), *argv], capture_output=True, text=True, timeout=300,
                              cwd=README.parent)
        assert proc.returncode == 0, proc.stderr
        missing = _shown_in_order(shown, proc.stdout.splitlines())
        assert missing is None, (f"README's `bmt-wrap {' '.join(argv)}` shows {missing!r}, which the command "
                                 f"no longer prints:\n{proc.stdout}")


def test_plan_and_dump_show_pipeline_stages(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", f"{MODELS}:llama", "--world-size", "4", "--pp-size", "2", "--microbatches",
                       "4", "--input", "input_ids=int64[4,16]")
    assert code == 0, out
    assert "2 stages x data-parallel 2" in out and "bubble (P-1)/(M+P-1) = 20.0%" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+[01]\s+1\s", line)]
    assert len(rows) == 2 and rows[0][8:10] == ["0", "B"] and rows[1][8:10] == ["8.00", "KiB"]  # GPipe: 4 x 2 KiB
    assert "stage 1: 1 block(s) model.layers.1; root: model.norm.weight, lm_head.weight" in out
    code, out, _ = run(capsys, "dump", f"{MODELS}:ToyGPT", "--world-size", "2", "--pp-size", "2")
    assert code == 0 and "pipeline: 2 stages, 2 micro-batches" in out
    code, _, err = run(capsys, "plan", f"{MODELS}:ToyGPT", "--world-size", "3", "--pp-size", "2")
    assert code == 2 and "--pp-size 2 must divide every --world-size" in err
    code, _, err = run(capsys, "plan", f"{MODELS}:ToyGPT", "--world-size", "8", "--pp-size", "8")
    assert code == 2 and "4 block(s)" in err


def test_plan_shows_pipeline_stages_with_tp_inside(capsys: pytest.CaptureFixture[str]) -> None:
    # pp2 x tp2 at 4 ranks against pp2 at 2 (one data-parallel rank each): TP halves every stage's shards per
    # rank, the split slices and the whole parameters sharded over the stage's TP pair alike
    def shards(*extra: str) -> tuple[str, list[float]]:
        code, out, err = run(capsys, "plan", f"{MODELS}:ToyGPT", "--pp-size", "2", "--input", "int64[2,8]", *extra)
        assert code == 0, err
        rows = [line.split() for line in out.splitlines() if re.match(r"\s+[01]\s+2\s", line)]
        assert len(rows) == 2 and all(r[3] == "KiB" for r in rows), out
        return out, [float(r[2]) for r in rows]
    out, tp = shards("--world-size", "4", "--tp-size", "2")
    assert "2 stages x TP 2 x data-parallel 1" in out and "parameters per TP rank" in out
    _, plain = shards("--world-size", "2")
    assert all(t == pytest.approx(p / 2, rel=0.01) for t, p in zip(tp, plain, strict=True)), (tp, plain)
    code, _, err = run(capsys, "plan", f"{MODELS}:ToyGPT", "--world-size", "6", "--pp-size", "2", "--tp-size", "2")
    assert code == 2 and "--pp-size 2 x --tp-size 2 must divide every --world-size" in err


def _in_flight_by_torch(size: int, virtual: int, micro: int, rank: int) -> int:
    """The most forwards without their backward yet in torch's own Interleaved1F1B order for ``rank``."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    shape = SimpleNamespace(n_local_stages=virtual, microbatches_per_round=micro // max(1, micro // size),
                            pp_group_size=size, _n_microbatches=micro)
    held = most = 0
    for action in ScheduleInterleaved1F1B._calculate_single_rank_operations(shape, rank):
        if action is not None:
            held += {_ComputationType.FORWARD: 1, _ComputationType.FULL_BACKWARD: -1}.get(action.computation_type, 0)
            most = max(most, held)
    return most


def test_plan_shows_virtual_stages_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    # --virtual-stages V: P x V stages round the ranks, each rank's sums over its stages, the interleaved bubble
    argv = ["plan", f"{MODELS}:ToyGPT", "--world-size", "4", "--pp-size", "2", "--virtual-stages", "2",
            "--microbatches", "4", "--input", "int64[2,8]", "--input", "int64[2,8]"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "2 ranks x 2 stages x data-parallel 2" in out and "(P-1)/(V*M+P-1) = 11.1%" in out  # 1 / (2 x 4 + 1)
    kib = {"B": 1 / 1024, "KiB": 1.0, "MiB": 1024.0}
    stages = [line.split() for line in out.splitlines() if re.match(r"\s+[0-3]\s+[01]\s+1\s", line)]
    assert [row[1] for row in stages] == ["0", "1", "0", "1"], out
    ranks = [line.split() for line in out.splitlines() if re.match(r"\s+[01]\s+\d,\d\s", line)]
    assert [row[1] for row in ranks] == ["0,2", "1,3"], out
    for r, row in enumerate(ranks):
        mine = [s for s in stages if s[1] == str(r)]
        for col, stage_col in ((2, 3), (4, 5)):  # shards and held/step: the sums of its stages'
            assert float(row[col]) * kib[row[col + 1]] == pytest.approx(
                sum(float(s[stage_col]) * kib[s[stage_col + 1]] for s in mine), abs=0.02), (row, mine)
        gpipe, interleaved = float(row[6]) * kib[row[7]], float(row[8]) * kib[row[9]]
        assert interleaved < gpipe, row  # 1F1B's order holds fewer micro-batches' activations than every one
        assert int(row[10]) == _in_flight_by_torch(2, 2, 4, r) == (5, 3)[r], row
    code, _, err = run(capsys, "plan", f"{MODELS}:ToyGPT", "--world-size", "4", "--pp-size", "2",
                       "--virtual-stages", "3")
    assert code == 2 and "--virtual-stages 3" in err and "6 pipeline stages" in err, err
    code, _, err = run(capsys, "plan", f"{MODELS}:ToyGPT", "--world-size", "4", "--virtual-stages", "2")
    assert code == 2 and "--virtual-stages" in err and "--pp-size" in err, err

    # --memory answers for the rank whose stages sum highest under the GPipe loop
    code, out, err = run(capsys, *argv, "--memory", "1GiB", "--baseline", "100MiB", "--streaming", "--json")
    assert code == 0, err
    answer = json.loads(out)
    phases = {f"rank {r}": float(row[6]) * kib[row[7]] for r, row in enumerate(ranks)}
    assert answer["virtual_stages"] == 2 and answer["training_phases"].keys() == phases.keys(), answer
    assert all(answer["training_phases"][k] / 1024 == pytest.approx(v, abs=0.01) for k, v in phases.items()), answer
    assert answer["counted_per_rank"] == 100 * 2**20 + max(answer["training_phases"].values()), answer
    code, out, _ = run(capsys, *argv, "--memory", "1GiB", "--baseline", "100MiB", "--streaming")
    assert code == 0 and "on rank 0 (stages 0, 2)" in out and "under Interleaved1F1B" in out, out
