"""ExpertView: one local expert's adapter pair inside a stacked ExpertLora, read-only.

    view = lora.expert(e)        # lora: an ExpertLora (lora/expert_lora.py)
    view.global_name             # "decoder.layers.3.mlp.experts.5.linear_fc1"
    view.lora_A, view.lora_B     # [r_e, in_local], [out_local, r_e]: views of the stacked tensors
    view.grad("lora_A")          # that expert's slice of the stacked gradient

Not a module and not an adapter: what merging, export and checks need of one expert (its base
layer, geometry, config, scaling, factors, DoRA magnitude), as views that share the stacked
tensors' storage and device.
"""

from __future__ import annotations

from typing import Optional

import torch


class ExpertView:
    """Local expert e's adapter pair, read-only: views of the stacked tensors (not Parameters)."""

    def __init__(self, owner: torch.nn.Module, local: int):  # owner: the ExpertLora
        self.owner, self.local = owner, local
        self.global_expert = owner.first_expert + local
        self.global_name = owner.names[local]
        self.base_layer = owner.bases[local]
        self.geometry = owner.geometry
        self.config = owner.configs[local]
        self.scaling = owner.scales[local]

    @property
    def rank(self) -> int:
        return self.owner.ranks[self.local]

    @property
    def lora_A(self) -> torch.Tensor:
        """[r_e, in_local] (the stacked tensor's rows without the zero padding)."""
        return self.owner.lora_A[self.local, :self.rank]

    @property
    def lora_B(self) -> torch.Tensor:
        """[out_local, r_e]."""
        return self.owner.lora_B[self.local, :, :self.rank]

    @property
    def magnitude(self) -> Optional[torch.Tensor]:
        m = self.owner.magnitude
        return None if m is None else m[self.local]

    def grad(self, name: str) -> Optional[torch.Tensor]:
        """This expert's slice of the stacked parameter's gradient (`main_grad` under megatron
        DDP, else `.grad`), or None before any backward."""
        p = getattr(self.owner, name)
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        if g is None:
            return None
        g = g[self.local]
        if name == "lora_A":
            return g[:self.rank]
        return g[:, :self.rank] if name == "lora_B" else g


__all__ = ["ExpertView"]
