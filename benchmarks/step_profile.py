"""Where a LoRA training step's time goes: a torch.profiler breakdown by part of the model.

    .venv/bin/python benchmarks/step_profile.py            # about 1-2 minutes on 2 CPU cores
    .venv/bin/python benchmarks/step_profile.py --tiny     # seconds (the suite's smoke test)

The model and step are benchmarks/train.py's (a small Mixtral, LoRA r=16 on q/k/v/o and every
expert's fc1/fc2, fp32, world size 1, megatron-core's DDP and optimizer, the default experts
module). One warm-up step, then `--steps` profiled steps; each part's share is its summed op time
over those steps.

How ops are attributed (no sampling; every op the profiler records is counted once, by its own
self time):
- forward: each part of the model runs inside a `record_function` range opened by forward
  hooks on its module (by type: attention core, the rest of attention, router, experts,
  the MoE layer's remainder = the token dispatcher's permute/combine, norms, embedding, output
  layer + loss, LoRA adapters); an op belongs to its innermost range. Inside an adapter the base
  layer's ops belong to the part holding the adapter, the rest to "lora"; the grouped experts'
  LoRA term (ExpertLora.grouped, the stacked expert adapters' grouped product) to "lora".
- backward: the autograd node of each forward op carries the op's sequence number; every op
  run under that node's `evaluate_function` belongs to the forward op's part (AccumulateGrad:
  the trainable parameters', i.e. "lora").
- the optimizer's step and gradient zeroing run in an "optimizer" range.
What no range covers (megatron's gradient finalisation, the autograd engine and Python between
ops) is "other". Ends with one JSON line: each part's share of the step, step_s, and
unclaimed_op_share (the profiled ops' own time no part claimed, without the wall clock's rest).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

PREFIX = "mlora::"
BASE = "base"  # the base layer inside an adapter: its ops belong to the adapter's holder


def _part_of(module, parent_part):
    """The part a module's ops belong to (None: its parent's)."""
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding)
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_lora.lora.adapter import LoraAdapter
    from megatron_lora.lora.experts import ExpertSlot

    if isinstance(module, (LoraAdapter, ExpertSlot)):  # an expert's slot: base + its term
        return "lora"
    if isinstance(module, LanguageModelEmbedding):
        return "embedding"
    if isinstance(module, Attention):
        return "attention (projections, rope)"
    if isinstance(module, TopKRouter):
        return "router"
    if isinstance(module, SequentialMLP):
        return "experts (base)"
    if isinstance(module, MoELayer):
        return "dispatcher (permute, combine)"
    if type(module).__name__.endswith("Norm"):
        return "norms"
    return None


def instrument(model) -> list:
    """Forward pre/post hooks opening a record_function range per part; returns the handles."""
    from megatron.core.transformer.attention import Attention
    from torch.autograd.profiler import record_function

    from megatron_lora.lora.adapter import LoraAdapter
    from megatron_lora.lora.expert_lora import ExpertLora
    from megatron_lora.lora.experts import ExpertSlot

    handles, open_ranges = [], []

    def add(module, label):
        def pre(_m, _args):
            r = record_function(PREFIX + label)
            r.__enter__()
            open_ranges.append(r)

        def post(_m, _args, _out):
            open_ranges.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))

    def walk(module, part):
        mine = _part_of(module, part)
        if mine is not None:
            add(module, mine)
        if isinstance(module, (LoraAdapter, ExpertSlot)):
            add(module.base_layer, BASE)
        if isinstance(module, Attention):
            add(module.core_attention, "attention (core)")
        for child in module.children():
            walk(child, mine or part)

    walk(model, None)
    output = getattr(model, "output_layer", None)
    if output is not None:
        add(output, "output layer + loss")
        loss_fn = model.compute_language_model_loss

        def loss(*args, **kwargs):
            with record_function(PREFIX + "output layer + loss"):
                return loss_fn(*args, **kwargs)

        model.compute_language_model_loss = loss
    original = ExpertLora.grouped

    def grouped_lora(self, *args, **kwargs):
        with record_function(PREFIX + "lora"):
            return original(self, *args, **kwargs)

    ExpertLora.grouped = grouped_lora
    handles.append(_Restore(ExpertLora, "grouped", original))
    return handles


class _Restore:
    """Puts a patched class attribute back on close()."""

    def __init__(self, cls, name, value):
        self.cls, self.name, self.value = cls, name, value

    def close(self):
        setattr(self.cls, self.name, self.value)


def _range_part(event):
    """The part of the innermost range around `event` (None: none)."""
    skip_lora = False
    node = event
    while node is not None:
        if node.name.startswith(PREFIX):
            label = node.name[len(PREFIX):]
            if label == BASE:
                skip_lora = True
            elif not (label == "lora" and skip_lora):
                return label
        node = node.cpu_parent
    return None


def attribute(events) -> dict:
    """{part: seconds of self time} over the profiler's events (see the module docstring)."""
    by_seq = {}
    for e in events:
        if e.sequence_nr is not None and e.sequence_nr >= 0 and not e.name.startswith(
                "autograd::engine"):
            part = _range_part(e)
            if part is not None:
                by_seq[(e.thread, e.sequence_nr)] = part
    seconds = defaultdict(float)
    for e in events:
        if e.name.startswith(PREFIX):
            seconds[_range_part(e) or "other"] += e.self_cpu_time_total / 1e6
            continue
        part = _range_part(e)
        node = e
        while part is None and node is not None:
            if node.name.startswith("autograd::engine::evaluate_function"):
                if "AccumulateGrad" in node.name:
                    part = "lora"
                else:
                    part = by_seq.get((node.fwd_thread, node.sequence_nr))
                break
            node = node.cpu_parent
        seconds[part or "other"] += e.self_cpu_time_total / 1e6
    return dict(seconds)


def profile(args) -> dict:
    import torch
    from torch.autograd.profiler import record_function

    from megatron_lora import runtime
    from megatron_lora.training.step import forward_backward
    from train import batches, build_ours

    torch.set_num_threads(args.threads)
    info, wrapped, optimizer = build_ours(args, port=29543)
    model = wrapped[0]
    while hasattr(model, "module"):  # megatron's DDP (and any other) wrapper
        model = model.module
    handles = instrument(model)
    data = batches(info.vocab_size, args.batch, args.seq, args.steps + 1)

    def step(rows):
        with record_function(PREFIX + "optimizer"):
            wrapped[0].zero_grad_buffer()
            optimizer.zero_grad()
        forward_backward(wrapped, rows[:, :-1], rows[:, 1:], micro_batch_size=args.batch)
        with record_function(PREFIX + "optimizer"):
            optimizer.step()

    step(data[0])  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for rows in data[1:]:
            step(rows)
        wall = time.perf_counter() - start
    for h in handles:
        h.close() if isinstance(h, _Restore) else h.remove()
    seconds = attribute(prof.events())
    # the share of the profiled ops' own time that no part claimed (the wall clock's remainder,
    # Python between ops, is added to "other" after)
    unclaimed = seconds.get("other", 0.0) / max(sum(seconds.values()), 1e-12)
    seconds["other"] = seconds.get("other", 0.0) + max(0.0, wall - sum(seconds.values()))
    runtime.shutdown()
    return {"step_s": wall / args.steps, "seconds": seconds, "wall": wall,
            "unclaimed_op_share": unclaimed}


ORDER = ["attention (core)", "attention (projections, rope)", "router",
         "dispatcher (permute, combine)", "experts (base)", "lora", "norms", "embedding",
         "output layer + loss", "optimizer", "other"]


def main(argv=None) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    from train import add_model_args, make_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, steps=3)
    p.add_argument("--tiny", action="store_true", help="a tiny model (a smoke test)")
    args = p.parse_args(argv)
    if args.tiny:
        args.hidden, args.vocab, args.seq, args.steps = 64, 256, 32, 1
    with tempfile.TemporaryDirectory() as tmp:
        args.hf = os.path.join(tmp, "hf")
        make_model(args.hf, args.hidden, args.layers, args.experts, args.vocab)
        result = profile(args)
    total = sum(result["seconds"].values())
    print(f"Mixtral h={args.hidden}, {args.layers} layers, {args.experts} experts top-2, batch "
          f"{args.batch}x{args.seq}, LoRA r=16 on {' '.join(args.targets)}, fp32, "
          f"{args.threads} threads, {args.steps} profiled steps")
    print(f"{'part':32s} {'ms/step':>8s} {'share':>7s}")
    shares = {}
    for part in ORDER + sorted(set(result["seconds"]) - set(ORDER)):
        s = result["seconds"].get(part, 0.0)
        shares[part] = round(s / total, 4)
        print(f"{part:32s} {1e3 * s / args.steps:8.1f} {100 * s / total:6.1f}%")
    print(json.dumps({"step_s": round(result["step_s"], 4), "shares": shares,
                      "unclaimed_op_share": round(result["unclaimed_op_share"], 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
