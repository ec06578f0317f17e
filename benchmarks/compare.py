"""bmt_wrap against plain PyTorch, DDP, FSDP2 and FSDP1 on the same model, data and seed, side by side.

    python benchmarks/compare.py [--world-size 2] [--model toy-gpt|gpt2|llama] [--steps 12] [--rounds 2]
                                 [--systems single,ddp,fsdp2,fsdp1,bmt_explicit,bmt_wrapper,bmt_wrapper_budget]
                                 [--json out.json] [--plot out.png] [--out table.md]

Systems: ``single`` (one process, the whole global batch), ``ddp``, ``fsdp2`` (``fully_shard`` per block
and on the root), ``fsdp1`` (transformer wrap policy on the block class), ``bmt_explicit`` (the model
written with BMTrain's API: toy-gpt only), ``bmt_wrapper`` (``bmt.BMTrainModelWrapper(model)``) and
``bmt_wrapper_budget`` (the same with ``memory_budget=`` DDP's need: a replica's parameters, gradients and
AdamW state plus every activation, by the plan's estimate). Every system uses
``torch.optim.AdamW(fused=True)``. The table gives each system's median (min-max) step time and peak RSS
per rank as ratios to FSDP2 and to DDP measured in the same run; for bmt_wrap, the bytes communicated per
step beside the ZeRO-3 bound 3Ψ(N-1)/N and the plan's own prediction, and which blocks kept activations
and parameters gathered (a line under the table names them for the budget system). The Markdown
table is printed and written to ``--out`` (default ``benchmarks/results/compare_<model>.md``).
"""

from __future__ import annotations

from harness import main

DEFAULT_SYSTEMS = ["single", "ddp", "fsdp2", "fsdp1", "bmt_explicit", "bmt_wrapper", "bmt_wrapper_budget"]

if __name__ == "__main__":
    main(__doc__, DEFAULT_SYSTEMS)
