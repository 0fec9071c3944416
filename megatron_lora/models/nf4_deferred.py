"""Build a model whose decoder linear weights are never allocated, for an NF4 base loaded in place.

    with deferred_decoder_linears():
        model = build_model(info, config, use_te=False)
    deferred_linears(model)        # [(name, linear)] whose weight is a meta Parameter

While the context is open, every `weight` Parameter that a megatron-core ColumnParallelLinear
or RowParallelLinear (the exact classes, as models/nf4_linear.py converts) registers is
replaced, as it is registered, by a Parameter on the meta device: the same shape, dtype and
requires_grad, no storage. megatron registers the weight and then initialises it
(`perform_initialization`: one global fp32 master weight per linear, transient, exactly as
without deferral, so the global RNG advances as it would) and sets its parallel attributes
(tensor_model_parallel, partition_dim, partition_stride, allreduce) on the Parameter it holds:
the meta one, which keeps the attributes and none of the values. The `torch.empty` megatron
allocated first is released at once, its pages never written. Before each linear the heap's
free pages are returned to the OS (runtime/heap.py): without that, the initialisation
transients left resident grew the build's peak by about the full-precision model.

Only the decoder's linears are deferred: the hook stops when the model registers its
`decoder` (GPTModel builds its embedding, then the decoder, then the output layer, which keeps
a real weight: at PP > 1 a tied output layer is filled from the embedding by a collective at
construction). Everything else (embeddings, output layer, norms, routers, biases) is built as
usual.

A deferred linear has no values until its weight is given: convert/load_nf4.py reads each
one's full-precision shard, quantises it (models/nf4_model.quantize_linear_) and drops it. A
forward, `.to()` of the weight or a checkpoint load into it before then fails or is wrong, so
use this context only for a model whose decoder linears are loaded that way.
"""

from __future__ import annotations

import contextlib
from typing import List, Tuple

import torch
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from megatron_lora.runtime.heap import release_free_heap


@contextlib.contextmanager
def deferred_decoder_linears():
    """Within: the decoder linears built get meta `weight` Parameters (see the module docstring).
    Not reentrant; the hooks are removed on exit, also on an exception."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    linear_types = (ColumnParallelLinear, RowParallelLinear)
    state = {"on": True}

    def on_parameter(module, name, param):
        if not state["on"] or name != "weight" or param is None or type(module) not in linear_types:
            return None
        release_free_heap()  # the previous linear's initialisation transients
        return torch.nn.Parameter(torch.empty_like(param, device="meta"),
                                  requires_grad=param.requires_grad)

    def on_module(module, name, submodule):
        if name == "decoder":
            state["on"] = False
        return None

    handles = [register_module_parameter_registration_hook(on_parameter),
               register_module_module_registration_hook(on_module)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def deferred_linears(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """(name, linear) of every module of `model` whose `weight` is a meta Parameter, in
    named_modules order."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m._parameters.get("weight"), torch.Tensor)
            and m._parameters["weight"].is_meta]


def to_device_(model: torch.nn.Module, device) -> torch.nn.Module:
    """model.to(device) for every parameter and buffer that is not deferred (meta stays meta)."""
    device = torch.device(device)
    return model._apply(lambda t: t if t.is_meta else t.to(device))


__all__ = ["deferred_decoder_linears", "deferred_linears", "to_device_"]
