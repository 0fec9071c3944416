"""Benchmark: activation memory kept for backward with and without full recomputation.

    .venv/bin/python benchmarks/recompute.py     # tiny Mixtral, s=256, b=2, fp32, one rank

The model is the tests' tiny Mixtral (4 layers, h=64, 4 heads / 2 query groups, 4 experts top-2,
vocabulary 256; megatron's DotProductAttention), LoRA r=8 on linear_qkv, linear_proj and every
expert's linear_fc1 / linear_fc2 with dropout 0.1, one rank on CPU (or the GPU when CUDA is
usable). One forward+backward of one micro-batch (`model(tokens, positions, labels=...)`, the
summed token losses) is run without recomputation and with full / uniform / 1-layer recomputation
(`--recompute-granularity full --recompute-method uniform --recompute-num-layers 1`).

How activation memory is measured: every tensor autograd saves for backward passes through
`torch.autograd.graph.saved_tensors_hooks`; the hook records the tensor's storage (counted once
however many saved tensors share it; parameters' storages excluded) and holds it until autograd
drops the saved tensor (after the node's backward). The peak of the live total over forward and
backward is the activation memory kept for backward, including what a recomputed forward saves
while its chunk's backward runs (the hooks stay active inside autograd's backward, where
megatron's CheckpointFunction recomputes). Deterministic, so one run per configuration; the step
time is the best of --reps runs.

`recompute_activation_ratio` = peak with full recomputation / peak without. The last line printed
is one JSON object with it, the peaks in bytes and the step times.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import weakref

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SavedActivations:
    """Live bytes of the storages autograd holds for backward (parameters excluded), and their
    peak. Use as a context manager around forward and backward."""

    def __init__(self, parameters):
        import torch

        self._torch = torch
        self._params = {p.untyped_storage().data_ptr() for p in parameters}
        self._refs = {}  # storage pointer -> [live saved tensors, bytes]
        self.live = 0
        self.peak = 0

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._params or storage.nbytes() == 0:
            return tensor
        entry = self._refs.setdefault(ptr, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        holder = _Held(tensor)
        weakref.finalize(holder, self._release, ptr)
        return holder

    def _release(self, ptr):
        entry = self._refs[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[ptr]

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Held) else packed

    def tracking(self):
        return self._torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def _step(model, tokens, labels, positions):
    loss = model(tokens, positions, None, labels=labels).sum()  # causal mask
    loss.backward()
    return loss.detach()


def measure(seq: int = 256, batch: int = 2, reps: int = 3) -> dict:
    """{"recompute_activation_ratio": peak with full recomputation / peak without, the peaks in
    bytes, the losses (equal) and best-of-`reps` step times}. Starts (and shuts down) a one-rank
    megatron world in this process."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import torch

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    from megatron.core.tensor_parallel import random as mrandom

    from megatron_lora import runtime
    from megatron_lora.lora.model import LoraConfig, apply_lora
    from megatron_lora.models.gpt import build_gpt_model, tiny_moe_shape, transformer_config

    runtime.init_process_group()
    layout = runtime.ParallelLayout()
    runtime.initialize(layout, seed=1)
    try:
        shape = tiny_moe_shape(max_position_embeddings=max(seq, 128))
        lora = LoraConfig(r=8, lora_alpha=16.0, lora_dropout=0.1, init_lora_weights=False,
                          target_modules=["linear_qkv", "linear_proj", "linear_fc1",
                                          "linear_fc2"])
        device = runtime.device()
        g = torch.Generator().manual_seed(3)
        rows = torch.randint(0, shape.vocab_size, (batch, seq + 1), generator=g)
        tokens, labels = rows[:, :-1].to(device), rows[:, 1:].to(device)
        positions = torch.arange(seq, device=device).unsqueeze(0).expand_as(tokens)
        states = mrandom._get_all_rng_states()
        weights, results = None, {}
        for name, overrides in (("none", {}), ("full", FULL)):
            model = build_gpt_model(shape, transformer_config(shape, layout, **overrides))
            apply_lora(model, lora, verbose=False)
            model.to(device)
            if weights is None:
                weights = {n: p.detach().clone() for n, p in model.named_parameters()}
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(weights[n])
            cpu, cuda, tracker = states
            mrandom._set_all_rng_states(cpu, cuda, dict(tracker))
            tracker_ = SavedActivations(model.parameters())
            with tracker_.tracking():
                loss = _step(model, tokens, labels, positions)
            times = []
            for _ in range(reps):
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                _step(model, tokens, labels, positions)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            results[name] = dict(peak=tracker_.peak, loss=float(loss), time=min(times),
                                 left=tracker_.live)
            del model
    finally:
        runtime.shutdown()
    none, full = results["none"], results["full"]
    return {
        "recompute_activation_ratio": full["peak"] / none["peak"],
        "peak_saved_bytes_no_recompute": none["peak"],
        "peak_saved_bytes_full_recompute": full["peak"],
        "loss_no_recompute": none["loss"],
        "loss_full_recompute": full["loss"],
        "step_time_s_no_recompute": none["time"],
        "step_time_s_full_recompute": full["time"],
        "step_time_ratio": full["time"] / none["time"],
        "seq_length": seq, "micro_batch_size": batch,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    result = measure(args.seq, args.batch, args.reps)
    print(f"{'recompute':>10} {'peak saved MiB':>15} {'step s':>8} {'loss':>10}")
    for name, key in (("none", "no_recompute"), ("full", "full_recompute")):
        print(f"{name:>10} {result['peak_saved_bytes_' + key] / 2**20:15.2f} "
              f"{result['step_time_s_' + key]:8.3f} {result['loss_' + key]:10.5f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
