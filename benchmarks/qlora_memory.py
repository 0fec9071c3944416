"""What a training step holds at once on CPU: LoRA on a bf16 base against QLoRA (an NF4 base).

    .venv/bin/python benchmarks/qlora_memory.py          # about half a minute on 2 CPU cores

A 2-layer MoE GPT (hidden 512, 8 experts of ffn 1024, top-2, GQA, vocab 1024), bf16, grouped
experts (--moe-grouped-gemm) run as one group as on CUDA (no CPU chunking), one rank; LoRA r=16
on attention and experts. One step (forward + backward of one [1, 256] batch, after a warm-up
step) runs under `LiveBytes`, which counts the bytes of the storages the step's operators create
while they are alive: the tensors the step makes and holds at once, the model's own tensors
(weights, NF4 codes) excluded. Prints both peaks side by side, the operator each peak was
reached at, the bytes of the largest grouped expert linear in bf16 (one layer's fc1 for all 8
experts) and the target: QLoRA's extra over LoRA <= 1.25 x that linear (one dequantised expert
at a time, no stacked copies of all experts). Ends with one JSON line.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SEQ, BATCH, RANK, TARGET = 256, 1, 16, 1.25
SHAPE = dict(vocab_size=1024, hidden_size=512, ffn_hidden_size=1024, num_layers=2,
             num_attention_heads=8, num_query_groups=2, num_experts=8)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created by the operators run under it, counted while they live.

    After each operator: storages of its outputs that are new (none of its inputs' storages, not
    seen before) are added with their size; storages that died since are dropped (a weak
    reference to each tells). `peak` is the largest live total seen after an operator, `peak_op`
    that operator, `live` the total now. Tensors made before the mode (weights, buffers) and
    views of them count nothing; an operator's internal scratch (inside one kernel) is not seen.
    """

    def __init__(self):
        super().__init__()
        self.tracked = {}  # storage key -> (weak reference, bytes)
        self.live = self.peak = 0
        self.peak_op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key, (ref, nbytes) in list(self.tracked.items()):
            if ref.expired():
                del self.tracked[key]
                self.live -= nbytes
        inputs = {_key(t) for t in tree_leaves((args, kwargs)) if _plain(t)}
        for t in tree_leaves(out):
            if not _plain(t):
                continue
            key = _key(t)
            if key in inputs or key in self.tracked:
                continue
            storage = t.untyped_storage()
            self.tracked[key] = (StorageWeakRef(storage), storage.nbytes())
            self.live += storage.nbytes()
        if self.live > self.peak:
            self.peak, self.peak_op = self.live, str(func)
        return out


def _plain(t) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_meta


def _key(t: torch.Tensor):
    s = t.untyped_storage()
    return s.device.type, s.data_ptr(), s.nbytes()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(nf4: bool, shape=None, rank: int = RANK, use_dora: bool = False):
    """The benchmark's model (one rank, parallel state initialised): bf16 GPT with grouped
    experts, NF4 base when nf4, LoRA on attention and experts."""
    from megatron_lora.families.shape import tiny_moe_shape
    from megatron_lora.lora.model import LoraConfig, apply_lora
    from megatron_lora.models.gpt import build_gpt_model, transformer_config
    from megatron_lora.models.nf4_model import quantize_base
    from megatron_lora.models.specs import local_block_spec
    from megatron_lora.runtime import ParallelLayout

    shape = tiny_moe_shape(**(shape or SHAPE))
    torch.manual_seed(0)
    config = transformer_config(shape, ParallelLayout(), dtype=torch.bfloat16)
    model = build_gpt_model(shape, config, block_spec=local_block_spec(
        config, pp_rank=0, moe_grouped_gemm=True))
    if nf4:
        quantize_base(model)
    apply_lora(model, LoraConfig(r=rank, lora_alpha=2 * rank, seed=1, init_lora_weights=False,
                                 use_dora=use_dora,
                                 target_modules=["linear_qkv", "linear_proj", "linear_fc1",
                                                 "linear_fc2"]), verbose=False)
    return model


def step(model, tokens: torch.Tensor) -> None:
    """Forward and backward of one batch (gradients into the adapters)."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    loss = model(tokens, positions, attention_mask=None, labels=tokens)
    loss.float().mean().backward()


def largest_grouped_linear_bytes(shape=None) -> int:
    """bf16 bytes of one layer's fc1 (gate and up) for all experts: the largest grouped linear."""
    s = shape or SHAPE
    return s["num_experts"] * 2 * s["ffn_hidden_size"] * s["hidden_size"] * 2


def measure(nf4: bool, shape=None, seq: int = SEQ) -> dict:
    """{peak, op}: what one step (after a warm-up step) holds at once under LiveBytes."""
    model = build(nf4, shape)
    vocab = (shape or SHAPE)["vocab_size"]
    tokens = torch.randint(0, vocab, (BATCH, seq), generator=torch.Generator().manual_seed(0))
    step(model, tokens)
    model.zero_grad(set_to_none=True)
    with LiveBytes() as mode:
        step(model, tokens)
    return {"peak": mode.peak, "op": mode.peak_op}


def main() -> int:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    torch.set_num_threads(1)
    from megatron_lora import runtime
    from megatron_lora.models import grouped_experts
    from megatron_lora.runtime import ParallelLayout

    grouped_experts.CPU_CHUNK_BYTES = 0  # all experts in one run, as on CUDA
    runtime.initialize(ParallelLayout(), seed=1234, backend="gloo")
    lora, qlora = measure(False), measure(True)
    runtime.shutdown()
    linear = largest_grouped_linear_bytes()
    extra = qlora["peak"] - lora["peak"]
    mb = 1e6
    print(f"{'step':<28}{'peak new bytes':>16}  at")
    print(f"{'LoRA (bf16 base)':<28}{lora['peak'] / mb:>13.1f} MB  {lora['op']}")
    print(f"{'QLoRA (NF4 base)':<28}{qlora['peak'] / mb:>13.1f} MB  {qlora['op']}")
    print(f"largest grouped expert linear (fc1, 8 experts) in bf16: {linear / mb:.1f} MB; "
          f"QLoRA extra {extra / mb:.1f} MB = {extra / linear:.2f} x (target <= {TARGET})")
    print(json.dumps({"lora_peak_bytes": lora["peak"], "qlora_peak_bytes": qlora["peak"],
                      "qlora_extra_bytes": extra, "largest_grouped_linear_bytes_bf16": linear,
                      "extra_over_linear": round(extra / linear, 3),
                      "target_met": extra <= TARGET * linear}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
