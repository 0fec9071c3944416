"""One forward/backward pass of a GPT model over a batch, through megatron-core's schedules.

The batch is global ([B, S] token ids, identical on every rank, on the rank's device); each
data-parallel rank takes its contiguous slice of B, and the slice is split into micro-batches that
megatron's schedule (no-pipelining, or 1F1B under PP) feeds through the model. The loss is the mean
over every unmasked token of the global batch, whatever the layout.

Nothing here reads a device value on the host: the global token count is the replicated batch's
own sum (no collective), and the returned loss is a device scalar.
"""

from __future__ import annotations

from functools import partial
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_lora import runtime
from megatron_lora.lora import dora
from megatron_lora.lora.dropout import clear_micro_batch_key, set_micro_batch_key
from megatron_lora.runtime.distributed import data_parallel_slice
from megatron_lora.runtime.rng import run_seed


def _loss_func(loss_mask: torch.Tensor, global_tokens: torch.Tensor,
               output_tensor: torch.Tensor):
    # Backward starts from (sum of this micro-batch's token losses) / (tokens in the global
    # batch): summed over micro-batches and DP ranks that is the gradient of the global mean.
    # calculate_per_token_loss=True stops the schedule from dividing by num_microbatches again.
    mask = loss_mask.float()
    total = (output_tensor.float() * mask).sum()
    count = mask.sum()
    report = {"loss_sum_and_count": torch.stack([total.detach(), count])}
    return total / global_tokens, count.to(torch.int), report


def _forward_step(global_tokens: torch.Tensor, iteration: int, data_iterator, model):
    tokens, labels, loss_mask, attention_mask, micro_batch = next(data_iterator)
    # On every stage, before this micro-batch's forward: its LoRA dropout key (lora/dropout.py).
    set_micro_batch_key(run_seed(), iteration, micro_batch)
    seq = tokens.shape[1]
    position_ids = torch.arange(seq, device=tokens.device).unsqueeze(0).expand_as(tokens)
    output = model(tokens, position_ids, attention_mask=attention_mask, labels=labels)
    return output, partial(_loss_func, loss_mask, global_tokens)


def finalize_pre_normalised_grads(model_chunks, num_tokens=None, **kwargs):
    """megatron's finalize_model_grads without its division by the token count.

    Our loss is already divided by the global token count (see _loss_func), and with
    calculate_per_token_loss=True megatron's DDP sums (not averages) gradients over DP, so the
    reduced gradients are exactly those of the global mean loss; dividing again would be wrong.
    Set as `config.finalize_model_grads_func` when training with megatron's DDP.
    """
    from megatron.core.distributed import finalize_model_grads

    from megatron_lora.lora.prefix import reduce_shared_prefix_grads

    # Prefix tuning's replicated projection (lora/prefix.py): summed over TP x PP before DP.
    reduce_shared_prefix_grads(model_chunks)
    return finalize_model_grads(model_chunks, None, **kwargs)


def forward_backward(
    model_chunks: Sequence[torch.nn.Module],
    tokens: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    micro_batch_size: int = 1,
    forward_only: bool = False,
    iteration: int = 0,
) -> torch.Tensor:
    """Run forward (and backward) over this DP rank's share of the global batch.

    tokens, labels, loss_mask: [B, S], the global batch, replicated on every rank, on the
    rank's device (training/loop.py moves it there).
    attention_mask: optional [B, 1, S, S] bool, True = masked (packed samples); None = causal.
    Gradients accumulate into `.grad` (or megatron DDP's main_grad) scaled so that they are the
    gradient of (sum of this DP rank's token losses) / (tokens in the global batch); summing them
    over DP gives the gradient of the global mean loss.
    Returns the global mean token loss (a float32 scalar on the rank's device), identical on
    every rank.
    LoRA dropout masks are keyed by (run seed, `iteration`, global micro-batch index, adapter),
    so the same global batch drops the same elements at every layout.
    """
    if loss_mask is None:
        loss_mask = torch.ones_like(tokens, dtype=torch.float32)
    # The batch is the same on every rank, so its token count is the global one: no collective,
    # no host read (a [] float32 tensor on the batch's device).
    global_tokens = loss_mask.sum(dtype=torch.float32)
    tokens, labels, loss_mask = (data_parallel_slice(t) for t in (tokens, labels, loss_mask))
    if attention_mask is not None:
        attention_mask = data_parallel_slice(attention_mask)
    if tokens.shape[0] % micro_batch_size:
        raise ValueError(
            f"per-DP-rank batch {tokens.shape[0]} is not divisible by micro_batch_size "
            f"{micro_batch_size}"
        )
    num_micro = tokens.shape[0] // micro_batch_size
    # This replica holds the global batch's contiguous share dp_rank: its i-th micro-batch is
    # the global batch's (dp_rank * num_micro + i)-th at every layout.
    first = parallel_state.get_data_parallel_rank() * num_micro
    micro = [
        (tokens[i : i + micro_batch_size], labels[i : i + micro_batch_size],
         loss_mask[i : i + micro_batch_size],
         None if attention_mask is None else attention_mask[i : i + micro_batch_size],
         first + i // micro_batch_size)
        for i in range(0, tokens.shape[0], micro_batch_size)
    ]
    config = model_chunks[0].config
    if not config.calculate_per_token_loss:
        raise ValueError(
            "forward_backward needs TransformerConfig.calculate_per_token_loss=True "
            "(megatron_lora.models.gpt.transformer_config sets it)"
        )
    forward_backward_func = get_forward_backward_func()
    dora.begin_step()  # the factors are fixed until the optimizer steps: one norm per adapter
    try:
        reduced = forward_backward_func(
            forward_step_func=partial(_forward_step, global_tokens, iteration),
            data_iterator=iter(micro),
            model=list(model_chunks),
            num_microbatches=num_micro,
            seq_length=tokens.shape[1],
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )
    finally:
        clear_micro_batch_key()
        dora.end_step()
    return _global_mean(reduced)


def _global_mean(reduced: List[dict]) -> torch.Tensor:
    """Sum (loss, count) over micro-batches, then over DP; broadcast from the last PP stage.
    A [] float32 tensor on the rank's device (the collectives are NCCL's on a GPU)."""
    pair = torch.zeros(2, dtype=torch.float32, device=runtime.device())
    if parallel_state.is_pipeline_last_stage():
        for item in reduced:
            pair += item["loss_sum_and_count"].float()
        dist.all_reduce(pair, group=parallel_state.get_data_parallel_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(pair, group=parallel_state.get_pipeline_model_parallel_group())
    return pair[0] / pair[1]
