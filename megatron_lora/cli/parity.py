"""`megatron-lora parity`: check that parallel layouts reproduce the single-rank loss.

    megatron-lora parity reference --dir D            # world size 1: weights + reference loss
    torchrun --nproc-per-node 4 -m megatron_lora parity check --dir D \\
        --layouts TP2+SP EP2 PP2xEP2 TP2xEP2+SP       # each layout on the same processes
"""

from __future__ import annotations

import os

from megatron_lora.cli.convert import HELP


def register(sub) -> None:
    p = sub.add_parser("parity", help="check layouts against the single-rank loss (tiny model)",
                       formatter_class=HELP)
    p.add_argument("stage", choices=["reference", "check"], help="reference: at world size 1, "
                   "save the tiny model's weights and loss; check: under torchrun, run each "
                   "--layouts entry on them and compare the loss")
    p.add_argument("--dir", required=True, help="folder for the reference weights and loss")
    p.add_argument("--layouts", nargs="+", default=["TP2+SP", "EP2", "PP2xEP2", "TP2xEP2+SP"],
                   metavar="LAYOUT", help="layouts to check, e.g. TP2xPP2xEP2+SP (each must fit "
                   "the world size)")
    p.add_argument("--dispatcher", choices=["allgather", "alltoall"], default="allgather",
                   help="megatron's MoE token dispatcher")
    p.add_argument("--rtol", type=float, default=1e-5, help="largest relative loss difference "
                   "from the single-rank reference that passes")
    p.set_defaults(func=_run)


def _run(args) -> int:
    import torch
    import torch.distributed as dist

    from megatron_lora import runtime
    from megatron_lora.models.gpt import tiny_moe_shape
    from megatron_lora.runtime import ParallelLayout
    from megatron_lora.testing import parity

    shape = tiny_moe_shape()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.set_num_threads(1)
    runtime.init_process_group()
    rank0 = dist.get_rank() == 0
    if args.stage == "reference":
        runtime.initialize(ParallelLayout())
        parity.run_reference(args.dir, shape)
        loss = float(parity.load_reference(args.dir)["loss"])
        if rank0:
            print(f"single-rank reference: loss {loss:.8f} (weights in {args.dir}/weights)")
        runtime.shutdown()
        return 0
    reference = float(parity.load_reference(args.dir)["loss"])
    failures = 0
    for name in args.layouts:
        layout = ParallelLayout.parse(name)
        runtime.initialize(layout, model_sizes=shape.layout_sizes())
        loss, _ = parity.run_layout(args.dir, shape, layout, dispatcher=args.dispatcher)
        rel = abs(float(loss) - reference) / abs(reference)
        ok = rel <= args.rtol
        failures += not ok
        if rank0:
            print(f"{layout.describe():>16} on {dist.get_world_size()} ranks: loss {float(loss):.8f} "
                  f"vs single-rank {reference:.8f}  rel diff {rel:.1e}  {'OK' if ok else 'MISMATCH'}")
        runtime.destroy()
    runtime.shutdown()
    if rank0:
        print("all layouts agree with the single-rank run" if not failures
              else f"{failures} layout(s) disagree with the single-rank run")
    return 1 if failures else 0
