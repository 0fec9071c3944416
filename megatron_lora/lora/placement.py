"""Where a megatron experts module's experts live: EP rank, EP size, local count, global index.

Local reads of the module's EP group only (no communication); shared by the expert adapters
(lora/experts.py) and the token-route bookkeeping (lora/token_route.py).
"""

from __future__ import annotations

import torch


def expert_placement(experts: torch.nn.Module) -> tuple:
    """(ep_rank, ep_size, num_local_experts) of a megatron experts module (local reads only)."""
    ep_group = getattr(experts, "ep_group", None)
    ep_rank = ep_group.rank() if ep_group is not None else 0
    ep_size = ep_group.size() if ep_group is not None else 1
    return ep_rank, ep_size, int(experts.num_local_experts)


def global_expert_index(experts: torch.nn.Module, local_index: int) -> int:
    """Global index of local expert `local_index` (megatron places experts contiguously)."""
    ep_rank, _, num_local = expert_placement(experts)
    return ep_rank * num_local + local_index
