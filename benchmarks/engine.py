"""Engine benchmark: bmt_wrap's engine with hand-marked blocks vs FSDP2 vs DDP, side by side.

    python benchmarks/engine.py [--world-size 2] [--steps 12] [--warmup 3] [--rounds 2] [--json out.json]

The engine runs a plan built without the passes (blocks marked by hand), so this measures the runtime
alone; ``compare.py`` adds the wrapper, the explicit API, FSDP1 and a single process. Same harness,
same options.
"""

from __future__ import annotations

from harness import main

if __name__ == "__main__":
    main(__doc__, ["bmt_engine", "fsdp2", "ddp"])
