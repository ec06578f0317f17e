"""Sweep every transformers architecture through bmt_wrap and write docs/coverage.md.

    python benchmarks/coverage.py                      # every model type, resumable, writes docs/coverage.md
    python benchmarks/coverage.py --only gpt2,llama    # a few types (merged into the same cache and report)
    python benchmarks/coverage.py --kinds causal-lm,image-cls --every-kind

Each model type of the auto mappings (causal LM, masked LM, seq2seq LM, sequence and image
classification) is built from its default config, shrunk (``arch_sweep.py`` says how), trained one plain
step, then wrapped at world size 1 with dropout on (bit-exact against plain PyTorch under the same seed)
and at 2 gloo ranks with dropout off (3 SGD steps against one process on the global batch, docs/design.md's
tolerances). By default a type appearing in several mappings runs once, under the first of ``--kinds``
that maps it; ``--every-kind`` runs each (kind, type) pair. Results are cached per case in
``benchmarks/results/coverage.json`` with a fingerprint of ``bmt_wrap/``'s sources, so a rerun only runs
what is missing or was measured on different engine code. Each case runs in persistent worker groups
(one of 1 rank, one of 2) with a per-case timeout; a hang or crash kills and rebuilds the group and is
recorded as that case's failure.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import arch_sweep  # noqa: E402

CACHE = ROOT / "benchmarks" / "results" / "coverage.json"
REPORT = ROOT / "docs" / "coverage.md"
# One kind per type by default, the first that maps it: an encoder-decoder as seq2seq, an encoder as a masked
# LM, a decoder as a causal LM (the heads the architectures are made for), then vision, then classifiers.
KIND_ORDER = ["seq2seq-lm", "masked-lm", "causal-lm", "image-cls", "seq-cls"]


def engine_fingerprint() -> str:
    """Hash of every source file under bmt_wrap/ (uncommitted edits included)."""
    h = hashlib.sha1()
    for path in sorted((ROOT / "bmt_wrap").rglob("*")):
        if path.is_file() and path.suffix in (".py", ".cuh", ".cu"):
            h.update(str(path.relative_to(ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:12]


def git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def select(kinds: list[str], only: list[str] | None, every_kind: bool) -> list[tuple[str, str, str]]:
    """The (kind, type, class) cases to run: one per type unless ``every_kind``."""
    chosen, seen = [], set()
    for kind, model_type, cls in arch_sweep.cases(kinds):
        if only and model_type not in only:
            continue
        if not every_kind and model_type in seen:
            continue
        seen.add(model_type)
        chosen.append((kind, model_type, cls))
    if only:
        missing = sorted(set(only) - seen)
        if missing:
            raise SystemExit(f"not in the {', '.join(kinds)} mappings: {', '.join(missing)}")
    return chosen


def load_cache() -> dict[str, Any]:
    if CACHE.exists():
        return json.loads(CACHE.read_text())
    return {"cases": {}}


def save_cache(cache: dict[str, Any]) -> None:
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    tmp = CACHE.with_suffix(".tmp")
    tmp.write_text(json.dumps(cache, indent=1, default=str))
    tmp.replace(CACHE)


# ---- failure classes ---------------------------------------------------------------------------------
def _normalise(text: str) -> str:
    text = re.sub(r"'[^']*'|\"[^\"]*\"|`[^`]*`", "…", text)
    text = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", text)
    return text[:110]


def failure_class(rec: dict[str, Any]) -> str:
    """A coarse pattern shared by models that fail for the same reason."""
    if rec.get("passed"):
        return ""
    if not rec.get("built"):
        return f"not built: {_normalise(rec.get('reason', '?'))}"
    if not rec.get("plain"):
        return f"plain step fails (model or input, not bmt_wrap): {_normalise(rec.get('reason', '?'))}"
    if rec.get("n1_reason"):
        return f"N=1 {rec['n1_stage']} raises: {_normalise(rec['n1_reason'])}"
    if rec.get("n2_reason"):
        return f"N=2 {rec['n2_stage']} raises: {_normalise(rec['n2_reason'])}"
    wrong = []
    if not rec.get("n1_exact"):
        wrong.append("N=1 " + _what(rec.get("n1_failures") or [], rec.get("n1_loss") or 0.0, n1=True))
    if not rec.get("n2_pass", rec.get("n2_ok")):
        wrong.append("N=2 " + _what([f.split(": ", 1)[-1] for f in rec.get("n2_failures") or []], 0.0))
    return "WRONG NUMBERS: " + "; ".join(wrong)


def _what(failures: list[str], loss_diff: float, n1: bool = False) -> str:
    if n1 and loss_diff > 1e-4:  # beyond the loss tolerance (losses are about 5.5 here)
        return "forward differs from plain PyTorch under the same seed (random stream: dropout / layer-drop)"
    if not failures:
        return "not bit-exact (last bits; within tolerance)" if n1 else "(within tolerance, not identical)"
    if all("no gradient but the shard has one" in f for f in failures):
        return "a parameter that got no gradient has a .grad (contract: None)"
    real = [f for f in failures if "no gradient but the shard has one" not in f]
    first = real[0]
    if first.startswith("losses differ"):
        return "wrong losses"
    if " buffer " in first:
        return "wrong buffers (updated again by the recompute?)"
    if " grad " in first:
        return "wrong gradients"
    return "wrong parameters"


# ---- the report ----------------------------------------------------------------------------------------
def _fmt(x: Any) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return "0" if x == 0 else f"{x:.1e}"
    return str(x)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:160]


def write_report(cache: dict[str, Any], keys: list[str], meta: dict[str, Any]) -> str:
    recs = [cache["cases"][k] for k in keys if k in cache["cases"]]
    types = sorted({r["model_type"] for r in recs})
    built = [r for r in recs if r.get("built")]
    scope = [r for r in built if r.get("plain")]
    passed = [r for r in scope if r.get("passed")]
    rate = f"{100 * len(passed) / len(scope):.1f}%" if scope else "–"
    wrong = [r for r in scope if failure_class(r).startswith("WRONG NUMBERS")]
    dp_only = [r for r in passed if not r.get("n2_ok")]
    lines = [
        "# Coverage: every transformers architecture through `BMTrainModelWrapper`",
        "",
        "Generated by `python benchmarks/coverage.py` (do not edit by hand). Each model type in transformers'",
        "auto mappings for causal LM, masked LM, seq2seq LM, sequence classification and image classification",
        "is built from its **default** config with only sizes shrunk (2 layers, hidden ≈64, 4 heads / 2 kv",
        "heads, intermediate ≈128, vocab 256, 32 px images with 4 px patches, token ids folded into the",
        "vocabulary; `use_cache` and every other default left as they are; sequence classifiers without a pad",
        "id get one), trained one plain step, then:",
        "",
        "- **N=1**: wrapped at world size 1, dropout on, 3 SGD(lr=0.1) steps, reseeded before each model's",
        "  step: losses, gradients, parameters and buffers must be **bit-identical** to plain PyTorch;",
        "- **N=2**: dropout/drop-path/layer-drop and router jitter noise 0, wrapped on 2 gloo ranks (each rank",
        "  2 of the 4 rows) vs one process on the global batch (models with BatchNorm: vs plain PyTorch fed each rank's slice with the",
        "  gradients averaged, buffers compared too), 3 SGD(lr=0.1) steps, docs/design.md's tolerances: losses rtol",
        "  1e-5, gradients and parameters `assert_close(rtol=1e-5, atol=1e-6)`. When the global reference",
        "  disagrees, the data-parallel reference (plain PyTorch on each rank's slice, gradients averaged: what",
        "  DDP computes) is tried too; matching it passes (\"pass (DP ref)\"): the two references differ by",
        "  nature there (rows coupled in the batch, or fp32 sums over a different batch split beyond atol).",
        "",
        f"Run: {meta['date']} · transformers {meta['transformers']} · torch {meta['torch']} · "
        f"git {meta['git']} · engine sources {meta['engine']} · {meta['runtime']}",
        "",
        "## Summary",
        "",
        "| | count |",
        "|---|---|",
        f"| model types enumerated | {len(types)} |",
        f"| cases run ((kind, type) pairs) | {len(recs)} |",
        f"| built from the shrunk default config | {len(built)} |",
        f"| **in scope** (built and trained one plain step) | **{len(scope)}** |",
        f"| **passed** (N=1 bit-exact and N=2 within tolerance) | **{len(passed)}** ({rate} of in scope) |",
        f"| of which matched only the data-parallel reference (N=2) | {len(dp_only)} |",
        f"| in scope, wrong numbers without an error | {len(wrong)} |",
        "",
        "| kind | cases | in scope | passed |",
        "|---|---|---|---|",
    ]
    for kind in KIND_ORDER:
        ks = [r for r in recs if r["kind"] == kind]
        if ks:
            ins = [r for r in ks if r.get("plain")]
            lines.append(f"| {kind} | {len(ks)} | {len(ins)} | {sum(1 for r in ins if r.get('passed'))} |")
    captures = Counter(r.get("n2_capture") or r.get("capture") or "–" for r in scope)
    lines += ["", "Capture methods among in-scope cases: "
              + ", ".join(f"{k} {v}" for k, v in captures.most_common()) + ".", "",
              "## Failures by reason", "", "| reason | cases | model types |", "|---|---|---|"]
    classes: dict[str, list[str]] = defaultdict(list)
    for r in recs:
        c = failure_class(r)
        if c:
            classes[c].append(r["model_type"])
    for c, ms in sorted(classes.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        shown = ", ".join(ms[:12]) + (f", … (+{len(ms) - 12})" if len(ms) > 12 else "")
        lines.append(f"| {_cell(c)} | {len(ms)} | {shown} |")
    lines += ["", "Reading the classes: *not built* and *plain step fails* are the shrunk default config or the",
              "inputs (token ids, or 32 px images only; no audio, no pixel inputs for multimodal LMs), not",
              "bmt_wrap: they are out of scope. *WRONG NUMBERS* means training ran without an error and a",
              "contract was missed: *a parameter that got no gradient has a .grad* (a zero shard gradient where",
              "torch leaves `None`: harmless under SGD, but AdamW's weight decay and momentum then move those",
              "parameters, which torch does not; typically unused towers of multimodal models, or poolers);",
              "*not bit-exact (last bits)* at N=1 (fp32 accumulation order, e.g. an encoder output read by",
              "every decoder layer); *forward differs under the same seed* at N=1 (the random stream is not",
              "the plain model's: dropout/layer-drop/jitter draws). Rerun one case with `python benchmarks/coverage.py --only TYPE --rerun`; the",
              "cached record (`benchmarks/results/coverage.json`) holds every rank's first violations and the",
              "traceback of any exception."]
    lines += ["", "## Every case", "",
              "N=2 columns: largest absolute loss / gradient / parameter difference over the 3 steps.", "",
              "| type | kind | class | built | plain | capture | blocks | ckpt | N=1 exact | N=2 loss | N=2 grad "
              "| N=2 param | result | reason |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(recs, key=lambda r: (r["model_type"], r["kind"])):
        yes = lambda v: "yes" if v else "no"  # noqa: E731
        result = ("out of scope" if not r.get("plain") else "FAIL" if not r.get("passed")
                  else "pass" if r.get("n2_ok") else "pass (DP ref)")
        n1 = "–" if r.get("n1_exact") is None else yes(r["n1_exact"])
        lines.append("| " + " | ".join([
            r["model_type"], r["kind"], r.get("class", ""), yes(r.get("built")), yes(r.get("plain")),
            _fmt(r.get("n2_capture") or r.get("capture")), _fmt(r.get("n2_blocks", r.get("blocks"))),
            _fmt(r.get("n2_checkpointed", r.get("checkpointed"))), n1, _fmt(r.get("n2_loss")),
            _fmt(r.get("n2_grad")), _fmt(r.get("n2_param")), result, _cell(arch_sweep.failure_reason(r))]) + " |")
    text = "\n".join(lines) + "\n"
    REPORT.write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default=",".join(KIND_ORDER), help=f"comma-separated, from {', '.join(KIND_ORDER)}")
    p.add_argument("--only", help="comma-separated model types (e.g. gpt2,llama)")
    p.add_argument("--every-kind", action="store_true", help="run each (kind, type) pair, not each type once")
    p.add_argument("--timeout", type=float, default=300, help="seconds per case and world size")
    p.add_argument("--rerun", action="store_true", help="ignore cached results for the selected cases")
    p.add_argument("--reuse-stale", action="store_true",
                   help="keep cached results measured on other bmt_wrap sources (run only missing cases)")
    p.add_argument("--no-report", action="store_true", help="do not rewrite docs/coverage.md")
    p.add_argument("--report-only", action="store_true", help="rewrite docs/coverage.md from the cache, run nothing")
    args = p.parse_args(argv)
    kinds = args.kinds.split(",")
    unknown = [k for k in kinds if k not in arch_sweep.KINDS]
    if unknown:
        p.error(f"unknown kind(s) {unknown}; choose from {KIND_ORDER}")
    only = args.only.split(",") if args.only else None

    import torch
    import transformers
    from tqdm import tqdm

    transformers.logging.set_verbosity_error()
    chosen = select(kinds, only, args.every_kind)
    engine = engine_fingerprint()
    cache = load_cache()
    def needed(key: str) -> bool:
        if args.rerun:
            return True
        rec = cache["cases"].get(key)
        return rec is None or (rec.get("engine") != engine and not args.reuse_stale)

    todo = [] if args.report_only else [c for c in chosen if needed(f"{c[0]}/{c[1]}")]
    t0 = time.perf_counter()
    bar = tqdm(todo, desc="coverage", unit="model", dynamic_ncols=True)
    passed = 0
    for kind, model_type, cls in bar:
        bar.set_postfix_str(f"{model_type} ({kind}) passed {passed}")
        rec = arch_sweep.run_case(kind, model_type, cls, timeout=args.timeout)
        rec["engine"] = engine
        passed += rec["passed"]
        cache["cases"][f"{kind}/{model_type}"] = rec
        save_cache(cache)
    bar.close()
    elapsed = time.perf_counter() - t0
    from dist_harness import shutdown_all

    shutdown_all()
    # The report covers the full default selection when it is cached, else what was asked for.
    full = select(KIND_ORDER, None, False) if not only else chosen
    keys = [f"{k}/{t}" for k, t, _ in full]
    if only:
        keys = sorted(set(keys) | {k for k, r in cache["cases"].items() if r.get("engine") == engine})
    secs = sum(cache["cases"][k].get("seconds", 0) for k in keys if k in cache["cases"])
    meta = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "transformers": transformers.__version__, "torch": torch.__version__, "git": git_head(),
            "engine": engine, "runtime": f"{secs / 60:.0f} min of case time on 2 shared CPU cores"}
    stale = [k for k in keys if cache["cases"].get(k, {}).get("engine") not in (engine, None)]
    if stale:
        meta["runtime"] += f" ({len(stale)} cases measured on older engine sources)"
    if not args.no_report:
        write_report(cache, keys, meta)
    done = [cache["cases"][k] for k in keys if k in cache["cases"]]
    scope = [r for r in done if r.get("plain")]
    print(f"{len(done)} cases, {len(scope)} in scope, {sum(r['passed'] for r in scope)} passed; "
          f"this run {elapsed / 60:.1f} min; report: {REPORT.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
