"""Command-line pieces shared by the subcommands (Megatron-LM flag names)."""

from __future__ import annotations

import os


def add_layout_args(p) -> None:
    g = p.add_argument_group("parallel layout")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="tensor-parallel ranks (TP)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline stages (PP)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="expert-parallel ranks (EP): experts are split among them")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="tensor-parallel ranks of each expert (ETP; unset: "
                   "--tensor-model-parallel-size)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split activations along the sequence over TP ranks (needed by MoE "
                   "layers with TP > 1)")
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"],
                   default="allgather", help="how tokens reach their experts' ranks")


def layout_from_args(args):
    from megatron_lora.runtime import ParallelLayout

    return ParallelLayout(
        tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
        ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size,
        sp=args.sequence_parallel)


def torchrun_env_defaults(port: int) -> None:
    """Let a command also run as a plain single process (world size 1)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
