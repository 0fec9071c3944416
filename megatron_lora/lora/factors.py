"""The LoRA factors as global tensors, and the two small pieces of arithmetic every adapter kind
shares: this rank's slice of a global factor, and the up-projection accumulated into the base output.

    a, b = init_global_factors(config, in_features, out_features, seed)  # A [r, in], B [out, r]
    b_local = shard_like_base(b, 0, tp_size, tp_rank, stride)              # as megatron splits W
    y = up_projection(u, b_local, add_to=base_output)                      # base + u B^T
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_lora.lora.config import AdapterConfig


def init_global_factors(
    config: AdapterConfig, in_features: int, out_features: int, seed: int
) -> tuple:
    """The global (A [r, in], B [out, r]) in fp32, from a CPU generator seeded with `seed`.

    kaiming: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform with a=sqrt(5), torch's Linear
    default), B = 0. gaussian: A ~ N(0, 1/r^2), B = 0. random (init_lora_weights=False): A as
    kaiming and B ~ U(-1/sqrt(r), 1/sqrt(r)).
    """
    r = config.rank
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    if config.init_scheme == "gaussian":
        a = torch.randn(r, in_features, generator=gen, device="cpu") / r
    else:
        bound = 1.0 / math.sqrt(in_features)
        a = torch.empty(r, in_features, device="cpu").uniform_(-bound, bound, generator=gen)
    if config.init_scheme == "random":
        bound = 1.0 / math.sqrt(r)
        b = torch.empty(out_features, r, device="cpu").uniform_(-bound, bound, generator=gen)
    else:
        b = torch.zeros(out_features, r, device="cpu")
    return a, b


def shard_like_base(t: torch.Tensor, dim: int, size: int, rank: int, stride: int = 1) -> torch.Tensor:
    """This rank's part of the global `t` along dim, as megatron splits a weight with
    `partition_stride`: chunks of t.shape[dim] / (size * stride), rank takes rank, rank+size..."""
    chunk = t.shape[dim] // (size * stride)
    parts = [t.narrow(dim, (j * size + rank) * chunk, chunk) for j in range(stride)]
    return parts[0] if stride == 1 else torch.cat(parts, dim=dim)


def up_projection(u: torch.Tensor, b: torch.Tensor, add_to: Optional[torch.Tensor]) -> torch.Tensor:
    """u [..., r] @ b^T [r, n] (+ add_to [..., n]).

    With add_to (the base output) the sum is one addmm: the up-projection accumulates into a
    single fresh [tokens, n] buffer instead of materialising the LoRA term and then a second
    buffer for the sum. addmm keeps u and b for backward, exactly as F.linear would.
    """
    b = b.to(u.dtype)
    if add_to is None:
        return F.linear(u, b)
    if add_to.dtype != u.dtype or add_to.shape[:-1] != u.shape[:-1]:
        return add_to + F.linear(u, b).to(add_to.dtype)
    n = add_to.shape[-1]
    out = torch.addmm(add_to.reshape(-1, n), u.reshape(-1, u.shape[-1]), b.t())
    return out.view(add_to.shape)


__all__ = ["init_global_factors", "shard_like_base", "up_projection"]
