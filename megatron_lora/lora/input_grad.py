"""Make a GPT model's decoder input require grad in training forwards.

With a frozen base nothing before the first decoder layer requires grad, so megatron's re-entrant
activation checkpoint (recomputation) sees no input that needs a gradient and gives the
parameters it recomputes (adapters, prefixes) none. A forward hook on the embedding marks its
output [s, b, h] (this rank's [s/tp, b, h] under SP) as requiring grad; used by recomputation
(models/recompute.py) and prefix tuning (lora/prefix.py).
"""

from __future__ import annotations

import torch


def _input_requires_grad(module, inputs, output):
    if torch.is_grad_enabled() and module.training and isinstance(output, torch.Tensor) \
            and not output.requires_grad:
        return output.requires_grad_(True)
    return output


def require_decoder_input_grad(model) -> bool:
    """On the first pipeline stage (a model with `.embedding`), make the embedding's output, the
    decoder input [s, b, h] (this rank's [s/tp, b, h] under SP), require grad in training
    forwards, so that re-entrant recomputation passes gradients to the parameters it recomputes
    (see the module docstring). Idempotent; False where the model has no embedding (later
    stages, whose input already requires grad)."""
    embedding = getattr(model, "embedding", None)
    if embedding is None:
        return False
    if not getattr(embedding, "_mlora_input_requires_grad", False):
        embedding.register_forward_hook(_input_requires_grad)
        embedding._mlora_input_requires_grad = True
    return True
