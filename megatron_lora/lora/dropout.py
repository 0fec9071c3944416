"""Layout-independent, regenerable dropout masks for the LoRA input.

Whether element (token i, feature j) of the global LoRA input [tokens, features] is kept is a
pure function of (key, i, j): a 32-bit integer hash of the global coordinates compared with
p * 2^32. Consequences:

- every layout drops the same global elements for the same key: a rank computes the mask of its
  own shard (sequence shard under SP, feature shard for a row-parallel input) from its global
  offsets, never a global mask;
- backward regenerates the mask from the saved key instead of keeping a dropped copy of the
  input (or even a 1-byte mask) alive between forward and backward;
- the key is drawn from the default generator of the input's device, the stream megatron keeps
  identical on every tensor-parallel rank for dropout outside TP regions. Activation
  recomputation restores that stream, so a recomputed forward draws the same key. Drawing it as
  a device tensor (no .item()) avoids a host-device sync.

Expert adapters see the dispatcher's permuted tokens, so their rows are not a contiguous range:
`keep_mask_at` takes each row's global token index explicitly (the token's position in its
data-parallel replica's [s, b] batch, flattened sequence-major, carried to the experts by
token_route.py), and every expert linear uses its own key stream `sub_key(key, 2 e + j)` of one
key drawn per MoE layer forward (e the global expert, j = 0 for fc1, 1 for fc2). So expert
dropout is the same at every EP / expert-TP / TP / dispatcher too.

The hash is the well-known 32-bit finaliser pattern (xor-shift / multiply), computed in int64 so
that no product overflows (multipliers are below 2^31, values below 2^32).
"""

from __future__ import annotations

from typing import Optional

import torch

_MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D  # odd multipliers below 2^31: products of 32-bit values stay below 2^63
_M2 = 0x6B43A9B5
_GOLDEN = 0x1E3779B9  # spreads consecutive token indices before hashing


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash of non-negative int64 values below 2^32 (elementwise)."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    x = x ^ (x >> 16)
    return x


# The name under which the current micro-batch's keying sits in megatron's RNG tracker (see
# set_micro_batch_key). The tracker is the carrier because activation recomputation saves its
# states with a checkpointed forward and restores them before recomputing it.
MICRO_BATCH_KEY = "megatron-lora-dropout-key"


def set_micro_batch_key(seed: int, iteration: int, micro_batch: int) -> None:
    """Key the masks of every adapter with a dropout stream by (seed, iteration, micro_batch).

    `micro_batch` is the GLOBAL index of the micro-batch (over data-parallel replicas: replica d
    of D, holding the global batch's contiguous share d, numbers its i-th d * per_replica + i),
    so a micro-batch gets the same masks at every layout. Called by the training step before
    each micro-batch's forward on every pipeline stage. Stored: int64 [3] = (the iteration's key
    [2], micro_batch)."""
    from megatron.core.tensor_parallel import random as mrandom

    seed = int(seed) & ((1 << 64) - 1)
    key = _mix32((torch.tensor([seed & _MASK32, seed >> 32], dtype=torch.int64, device="cpu")
                  + _GOLDEN)
                 & _MASK32)
    key = sub_key(key, int(iteration))
    state = torch.cat([key, torch.tensor([int(micro_batch)], dtype=torch.int64, device="cpu")])
    mrandom.get_cuda_rng_tracker().states_[MICRO_BATCH_KEY] = state


def clear_micro_batch_key() -> None:
    """Back to keys drawn from the default generator (after a training step)."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.get_cuda_rng_tracker().states_.pop(MICRO_BATCH_KEY, None)


def micro_batch_keying(device: torch.device, stream: int):
    """(int64 [2] the key of `stream` for this ITERATION, the global micro-batch index) inside a
    training step, else None. Experts use it: rows of several micro-batches (other replicas',
    under EP) meet in one expert call, so their masks are told apart by global token index
    (micro_batch * tokens per micro-batch + position), not by key."""
    from megatron.core.tensor_parallel import random as mrandom

    state = mrandom.get_cuda_rng_tracker().states_.get(MICRO_BATCH_KEY)
    if state is None:
        return None
    return sub_key(state[:2].to(device), stream), int(state[2])


def draw_dropout_key(device: torch.device, stream: Optional[int] = None) -> torch.Tensor:
    """int64 [2]: one forward's key.

    With a `stream` (the adapter's, lora/identity.py: dropout_stream) inside a training step: a
    pure function of (seed, iteration, global micro-batch, adapter), whatever the layout, the
    pipeline stage or the tensor-parallel RNG fork the forward runs in. Otherwise two 31-bit
    integers drawn from `device`'s default generator (a module used on its own)."""
    if stream is not None:
        keying = micro_batch_keying(device, stream)
        if keying is not None:
            key, micro_batch = keying
            return sub_key(key, micro_batch)
    return torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64, device=device)


def sub_key(key: torch.Tensor, stream: int) -> torch.Tensor:
    """int64 [2]: the key of stream `stream` (>= 0) derived from `key` (int64 [2]):
    _mix32((key + _mix32([2 stream + 1, 2 stream + 2])) mod 2^32). Distinct streams give
    unrelated masks; no random draw, so deriving keys never moves the generator."""
    salt = torch.tensor([2 * stream + 1, 2 * stream + 2], dtype=torch.int64, device=key.device)
    return _mix32((key + _mix32(salt & _MASK32)) & _MASK32)


def expert_keys(key: torch.Tensor, first_expert: int, num_experts: int,
                stream_offset: int) -> torch.Tensor:
    """int64 [num_experts, 2]: the keys of experts first_expert .. first_expert + num_experts - 1
    for one linear of theirs (stream_offset 0 for fc1, 1 for fc2) from a MoE layer's key: stream
    2 g + stream_offset of global expert g (token_route.py, lora/experts.py). Row e equals
    sub_key(key, 2 (first_expert + e) + stream_offset); all rows at once, on the key's device
    (no host-to-device copy per expert)."""
    streams = 2 * (first_expert + torch.arange(num_experts, dtype=torch.int64,
                                               device=key.device)) + stream_offset
    salt = torch.stack([2 * streams + 1, 2 * streams + 2], dim=1)  # [E, 2], as sub_key's
    return _mix32((key.unsqueeze(0) + _mix32(salt & _MASK32)) & _MASK32)


def keep_mask(
    key: torch.Tensor,
    p: float,
    token_offset: int,
    n_tokens: int,
    feature_offset: int,
    n_features: int,
) -> torch.Tensor:
    """bool [n_tokens, n_features]: True where global element (token_offset + i,
    feature_offset + j) is kept by dropout with probability p under `key`.

    Independent of how the global tensor is split: a shard's mask is the slice of the global mask.
    """
    tokens = torch.arange(token_offset, token_offset + n_tokens, dtype=torch.int64,
                          device=key.device)
    return keep_mask_at(key, p, tokens, feature_offset, n_features)


def keep_mask_at(
    key: torch.Tensor, p: float, tokens: torch.Tensor, feature_offset: int, n_features: int
) -> torch.Tensor:
    """bool [len(tokens), n_features]: row i is the global mask's row `tokens[i]` (any order,
    int64 global token indices >= 0), columns feature_offset .. feature_offset + n_features."""
    device = key.device
    tokens = tokens.to(device=device, dtype=torch.int64).reshape(-1)
    features = torch.arange(
        feature_offset, feature_offset + n_features, dtype=torch.int64, device=device
    )
    # Hash each coordinate with its half of the key, then the pair: [T, 1] and [1, F] vectors are
    # cheap; the [T, F] work is a few integer ops, done once in forward and once in backward.
    row = _mix32(((tokens & _MASK32) * _GOLDEN + key[0]) & _MASK32)
    row = _mix32(row ^ (tokens >> 32))  # tokens beyond 2^32 still get distinct rows
    col = _mix32((features + key[1]) & _MASK32)
    h = _mix32((row.unsqueeze(1) ^ col.unsqueeze(0)) & _MASK32)
    h = _mix32((h + row.unsqueeze(1)) & _MASK32)
    threshold = int(round(p * 2**32))
    return h >= threshold
