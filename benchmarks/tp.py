"""Tensor parallelism in the one-liner: tp2 x dp2 against dp4 (ZeRO-3 over 4 ranks) and DDP, side by side.

    python benchmarks/tp.py [--world-size 4] [--model toy-gpt-small] [--steps 6] [--rounds 2] [--out table.md]

Systems: ``bmt_wrapper`` (``BMTrainModelWrapper(model)``: ZeRO-3 over every rank), ``bmt_wrapper_tp2``
(``BMTrainModelWrapper(model, tp_size=2, tp_plan=...)``: the toy GPT's MLPs, embedding and head split over
adjacent rank pairs, ZeRO-3 over the two data-parallel ranks) and ``ddp``. Every system trains the same
global batch (``--batch`` x world size): under tp2 each TP pair computes a data-parallel rank's share, twice
dp4's per-rank batch, so the losses agree across systems. The table gives the
median step time, peak RSS per rank, and bytes per step beside the plan's estimate (TP traffic included),
written to ``--out`` (default ``benchmarks/results/tp_<model>.md``), which RESULTS.md quotes.
"""

from __future__ import annotations

import sys

from harness import main

DEFAULT_SYSTEMS = ["ddp", "bmt_wrapper", "bmt_wrapper_tp2"]
DEFAULTS = {"--world-size": "4", "--model": "toy-gpt-small", "--steps": "6", "--warmup": "2"}

if __name__ == "__main__":
    argv = sys.argv[1:]
    for flag, value in DEFAULTS.items():  # this script's defaults, where the command line gives none
        if flag not in argv:
            argv += [flag, value]
    main(__doc__, DEFAULT_SYSTEMS, argv)
