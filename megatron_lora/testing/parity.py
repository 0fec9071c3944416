"""Layout parity for a GPT model: the same global weights and batch must give the same loss and
the same gradients at every parallel layout as at world size 1.

`run_reference` (world size 1) builds a model, saves its weights and its loss and input-embedding
gradient; `run_layout` (any world) loads those weights at a layout, runs the same global batch and
returns what to compare.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import load_file, save_file

from megatron_lora import runtime
from megatron_lora.models.gpt import ModelShape, build_gpt_model, transformer_config
from megatron_lora.runtime.layout import ParallelLayout
from megatron_lora.testing.reference import load_weights, save_weights
from megatron_lora.training.step import forward_backward


@dataclass(frozen=True)
class ParityBatch:
    batch_size: int = 4
    seq_length: int = 32
    micro_batch_size: int = 1
    seed: int = 1234


def make_batch(shape: ModelShape, spec: ParityBatch) -> Tuple[torch.Tensor, torch.Tensor]:
    """Global token ids and next-token labels [B, S], the same on every rank, on the rank's
    device (drawn on the host from a seeded generator, so alike on any device)."""
    g = torch.Generator(device="cpu").manual_seed(spec.seed)
    tokens = torch.randint(0, shape.vocab_size, (spec.batch_size, spec.seq_length + 1),
                           generator=g, device="cpu").to(runtime.device())
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def gathered_embedding_grad(model: torch.nn.Module) -> Optional[torch.Tensor]:
    """The word-embedding gradient [V, h] summed over DP and gathered over TP (first PP stage
    only; None elsewhere)."""
    if not parallel_state.is_pipeline_first_stage():
        return None
    grad = model.embedding.word_embeddings.weight.grad.detach().clone()
    dist.all_reduce(grad, group=parallel_state.get_data_parallel_group())
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return grad
    parts = [torch.empty_like(grad) for _ in range(tp)]
    dist.all_gather(parts, grad, group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=0)


def assert_held_by(value: object, expected: int, what: str = "the result") -> bool:
    """Collective: assert that exactly `expected` ranks hold `value` (not None); True on them.

    A check written as `if value is not None: assert ...` passes without asserting anything
    when no rank holds the value (a wrong stage or writer-rank test); counting the holders over
    the world first closes that hole. Every rank raises alike (the count is all-reduced)."""
    held = torch.tensor([0 if value is None else 1], dtype=torch.int64, device=runtime.device())
    dist.all_reduce(held)
    if int(held.item()) != expected:
        raise AssertionError(f"{what} was returned on {int(held.item())} of "
                             f"{dist.get_world_size()} ranks, expected on {expected}")
    return value is not None


def loss_and_embedding_grad(model, shape: ModelShape, spec: ParityBatch = ParityBatch()):
    """Forward+backward of the parity batch; (global mean loss, gathered embedding grad or None)."""
    tokens, labels = make_batch(shape, spec)
    loss = forward_backward([model], tokens, labels, micro_batch_size=spec.micro_batch_size)
    return loss, gathered_embedding_grad(model)


def run_reference(directory: str, shape: ModelShape, spec: ParityBatch = ParityBatch()) -> None:
    """At world size 1: build, save weights to directory/weights, save loss and grads."""
    if dist.get_world_size() != 1:
        raise RuntimeError("run_reference runs at world size 1")
    layout = ParallelLayout()
    model = build_gpt_model(shape, transformer_config(shape, layout)).to(runtime.device())
    save_weights(model, os.path.join(directory, "weights"))
    loss, grad = loss_and_embedding_grad(model, shape, spec)
    save_file({"loss": loss.reshape(1).cpu(), "embedding_grad": grad.cpu()},
              os.path.join(directory, "reference.safetensors"))


def load_reference(directory: str) -> dict:
    return load_file(os.path.join(directory, "reference.safetensors"))


def run_layout(
    directory: str,
    shape: ModelShape,
    layout: ParallelLayout,
    spec: ParityBatch = ParityBatch(),
    dispatcher: str = "allgather",
):
    """Load the reference weights at `layout` and return (loss, gathered embedding grad or None)."""
    model = build_gpt_model(shape, transformer_config(shape, layout, dispatcher=dispatcher))
    model.to(runtime.device())
    load_weights(model, os.path.join(directory, "weights"))
    return loss_and_embedding_grad(model, shape, spec)
