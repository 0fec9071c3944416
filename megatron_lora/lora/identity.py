"""Global identities of adapters, and the seeds derived from them.

Every adapter is named by where it sits in the GLOBAL model, independent of the parallel layout:
`decoder.layers.{global_layer}.self_attention.linear_qkv`,
`decoder.layers.{global_layer}.mlp.experts.{global_expert}.linear_fc1`, `embedding`,
`output_layer`, ... Its initial factors are drawn from a generator seeded by (run seed, name), so
the adapter of a given module starts identical whatever the TP/PP/EP/ETP layout and whichever
rank holds it.
"""

from __future__ import annotations

import hashlib


def adapter_seed(base_seed: int, name: str) -> int:
    """A 63-bit seed from the run seed and an adapter's global name (stable across runs)."""
    digest = hashlib.sha256(f"{int(base_seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def dropout_stream(name: str) -> int:
    """A 31-bit dropout key stream from an adapter's global name (lora/dropout.py: sub_key):
    the same adapter gets the same masks at every layout."""
    digest = hashlib.sha256(f"dropout:{name}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def global_layer_prefix(layer) -> str:
    """`decoder.layers.{L}` for a megatron TransformerLayer (layer_number is 1-based, global)."""
    return f"decoder.layers.{layer.layer_number - 1}"
