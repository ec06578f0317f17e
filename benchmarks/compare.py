"""bmt_wrap against plain PyTorch, DDP, FSDP2 and FSDP1 on the same model, data and seed, side by side.

    python benchmarks/compare.py [--world-size 2] [--model toy-gpt|gpt2|llama] [--steps 12] [--rounds 2]
                                 [--systems single,ddp,fsdp2,fsdp1,bmt_explicit,bmt_wrapper]
                                 [--json out.json] [--plot out.png] [--out table.md]

Systems: ``single`` (one process, the whole global batch), ``ddp``, ``fsdp2`` (``fully_shard`` per block
and on the root), ``fsdp1`` (transformer wrap policy on the block class), ``bmt_explicit`` (the model
written with BMTrain's API: toy-gpt only) and ``bmt_wrapper`` (``bmt.BMTrainModelWrapper(model)``).
Every system uses ``torch.optim.AdamW(fused=True)``. The table gives each system's median (min-max)
step time and peak RSS per rank as ratios to FSDP2 measured in the same run; for bmt_wrap, the bytes
communicated per step beside the ZeRO-3 bound 3Ψ(N-1)/N and the plan's own prediction. The Markdown
table is printed and written to ``--out`` (default ``benchmarks/results/compare_<model>.md``).
"""

from __future__ import annotations

from harness import main

DEFAULT_SYSTEMS = ["single", "ddp", "fsdp2", "fsdp1", "bmt_explicit", "bmt_wrapper"]

if __name__ == "__main__":
    main(__doc__, DEFAULT_SYSTEMS)
