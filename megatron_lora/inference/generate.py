"""Autoregressive generation with a KV cache, at any parallel layout megatron-core trains at.

`generate(model, prompt_ids, config, eos_id=..., vocab_size=...)` adds tokens to one prompt; every
rank of the world calls it with the same prompt. The prompt is one forward pass (prefill), then
each new token is one forward pass of that token alone: megatron-core's SelfAttention appends the
new keys/values to a StaticInferenceContext (`runtime.versions.static_kv_cache`, one
[max_len, 1, groups/tp, head_dim] buffer pair per layer on this rank) and attends over the cache,
so a step costs the same whatever the length so far.

Parallel state:
- TP: each rank holds its heads' cache; megatron's output layer gathers the logits over TP.
- SP: the sequence of a forward call is split over the TP ranks, so a call's length must divide by
  tp. A chunk of n tokens is padded with (-n) % tp dummy tokens *after* it: causal attention keeps
  them out of the real tokens' results, their cache entries are overwritten by the next real
  tokens (the cache offset advances by n only), and the experts (dropless) give each real token
  the same output whatever else is routed with it.
- PP: megatron's forward-only schedule passes the activations between stages (one micro-batch).
- EP/DP: every data-parallel replica runs the same prompt, since the experts of one MoE layer are
  spread over ranks of different replicas and every rank must take part in each layer's dispatch.
- The token is chosen on one rank (last pipeline stage, TP rank 0, DP rank 0) and broadcast to the
  world, so every rank feeds the same token and stops at the same step.

The core attention must accept a multi-token step against a longer cache (megatron passes no mask
past the prompt): the local spec's SDPAttention does (`models.attention`), so `generate`
needs the model built with attention_backend="flash".
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_lora.convert.logits import is_writer_rank
from megatron_lora.inference.sampling import SamplingConfig, next_token
from megatron_lora.runtime.distributed import device as runtime_device
from megatron_lora.runtime.versions import static_kv_cache


def _chooser_rank() -> int:
    """Global rank of the last pipeline stage's TP rank 0 in DP replica 0 (a collective)."""
    flag = torch.tensor([dist.get_rank() if is_writer_rank() else -1], dtype=torch.int64,
                        device=runtime_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag)


def _forward(model, context, chunk: List[int], offset: int, tp_pad: int,
             vocab_size: int) -> Optional[torch.Tensor]:
    """Runs `chunk` (token ids at positions offset ..) through the model, filling the cache.
    Returns, on the last pipeline stage, the last real token's logits [vocab_size] (the whole
    vocabulary, megatron's padding dropped); None elsewhere."""
    n = len(chunk)
    pad = (-n) % tp_pad
    device = runtime_device()
    tokens = torch.tensor([chunk + [0] * pad], dtype=torch.int64, device=device)  # [1, n + pad]
    position_ids = torch.arange(offset, offset + n + pad, device=device).unsqueeze(0)
    context.sequence_len_offset = offset

    def step(data_iterator, m):
        # megatron's inference path gathers the vocabulary shards over TP itself.
        return m(next(data_iterator), position_ids, attention_mask=None,
                 inference_context=context, runtime_gather_output=True), None

    outputs = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter([tokens]), model=[model], num_microbatches=1,
        seq_length=n + pad, micro_batch_size=1, forward_only=True)
    if not parallel_state.is_pipeline_last_stage():
        return None
    return outputs[0][0, n - 1, :vocab_size].float()  # [1, n + pad, Vp] -> last real position


@torch.no_grad()
def generate(model: torch.nn.Module, prompt_ids: List[int], config: SamplingConfig, *,
             eos_id: Optional[int], vocab_size: int,
             generator: Optional[torch.Generator] = None) -> List[int]:
    """The ids generated after `prompt_ids` (same on every rank): at most config.max_new_tokens,
    ending with eos_id when it was generated (as transformers' generate returns it).

    model: this pipeline stage's GPTModel (megatron parallel state initialised; built with the
    SDPA core attention). The caller checks that len(prompt_ids) + max_new_tokens fits the
    model's max_position_embeddings before any collective."""
    if not prompt_ids:
        raise ValueError("generate needs at least one prompt token")
    model.eval()
    sp = bool(getattr(model.config, "sequence_parallel", False))
    tp_pad = parallel_state.get_tensor_model_parallel_world_size() if sp else 1
    pad = tp_pad - 1
    context = static_kv_cache(1, len(prompt_ids) + config.max_new_tokens + pad)
    chooser = _chooser_rank()
    choose_here = dist.get_rank() == chooser
    generator = generator or torch.Generator(device="cpu").manual_seed(config.seed)
    out: List[int] = []
    chunk, offset = list(prompt_ids), 0
    for _ in range(config.max_new_tokens):
        logits = _forward(model, context, chunk, offset, tp_pad, vocab_size)
        # One host read per token on every rank: the chooser's choice, the others' broadcast.
        chosen = next_token(logits, config, generator) if choose_here else -1
        token = torch.tensor([chosen], dtype=torch.int64, device=runtime_device())
        dist.broadcast(token, src=chooser)
        offset += len(chunk)
        chunk = [chosen if choose_here else int(token)]
        out.append(chunk[0])
        if chunk[0] == eos_id:
            break
    return out
