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


def error_once(message: str, wait_s: float = 30.0) -> None:
    """Print a user error that every rank found alike (the same inputs, before any collective)
    once: rank 0 prints it at once. Another rank under torchrun (whose output is all ranks'
    together) waits for rank 0 to print it and exit, which makes torchrun stop this rank
    (exiting first would make torchrun stop rank 0 before it printed); should rank 0 not end the
    job within `wait_s`, it prints the message after all. Ranks started some other way, each
    with its own output, print it at once. The caller exits non-zero on every rank."""
    import sys
    import time

    from megatron_lora.runtime.watchdog import under_torchrun

    if os.environ.get("RANK", "0") != "0" and under_torchrun() and \
            int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(wait_s)
    print(message, file=sys.stderr, flush=True)


COMPUTING_COMMANDS = ("train", "logits", "generate", "parity")


def default_threads() -> int:
    """torch's CPU threads for this rank when OMP_NUM_THREADS is unset: the cores this process
    may run on divided among the ranks on this node (LOCAL_WORLD_SIZE), at least 1, as torchrun
    does for several ranks (it sets 1). Several ranks each with every core's worth of threads
    (or one rank with more threads than its cores) slow down many times on a busy machine.
    Said once (rank 0) when it changes torch's count; OMP_NUM_THREADS, when set, decides."""
    import sys

    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    threads = max(1, cores // ranks)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
        if os.environ.get("RANK", "0") == "0":
            print(f"note: OMP_NUM_THREADS is unset: torch uses {threads} CPU thread(s) per rank "
                  f"({cores} cores for {ranks} ranks on this node); set OMP_NUM_THREADS to choose",
                  file=sys.stderr, flush=True)
    return threads
