"""Full-vocabulary logits of a megatron-core GPT model for a global batch, at any layout.

`forward_logits(model, tokens, vocab_size)` runs megatron's forward-only schedule (no pipelining,
or 1F1B under PP) over this data-parallel rank's share of the batch, gathers the last pipeline
stage's vocabulary shards over TP and the batch over DP, and drops the padded vocabulary columns.
The result, [B, S, vocab_size] fp32, is returned on exactly one rank (`is_writer_rank()`: last
pipeline stage, TP rank 0, DP rank 0); every other rank gets None.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_lora.runtime.distributed import data_parallel_slice


def is_writer_rank() -> bool:
    return (parallel_state.is_pipeline_last_stage()
            and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0)


def _forward_step(data_iterator, model):
    tokens = next(data_iterator)
    position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    # labels=None: the model returns logits [b, s, Vp/tp]; no loss function.
    return model(tokens, position_ids, attention_mask=None), None


def _gather(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    size = dist.get_world_size(group=group)
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def forward_logits(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    vocab_size: int,
    micro_batch_size: int = 1,
) -> Optional[torch.Tensor]:
    """tokens: [B, S] int64, the global batch (same on every rank; B divisible by DP *
    micro_batch_size). Returns logits [B, S, vocab_size] fp32 on the writer rank, else None."""
    model.eval()
    local = data_parallel_slice(tokens)
    if local.shape[0] % micro_batch_size:
        raise ValueError(f"per-DP-rank batch {local.shape[0]} is not divisible by "
                         f"micro_batch_size {micro_batch_size}")
    micro: List[torch.Tensor] = list(local.split(micro_batch_size))
    outputs = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter(micro),
        model=[model],
        num_microbatches=len(micro),
        seq_length=tokens.shape[1],
        micro_batch_size=micro_batch_size,
        forward_only=True,
    )
    if not parallel_state.is_pipeline_last_stage():
        return None
    logits = torch.cat([o.float() for o in outputs], dim=0)  # [B/dp, S, Vp/tp]
    logits = _gather(logits, parallel_state.get_tensor_model_parallel_group(), dim=-1)
    logits = logits[..., :vocab_size]
    logits = _gather(logits, parallel_state.get_data_parallel_group(), dim=0)
    return logits if is_writer_rank() else None
