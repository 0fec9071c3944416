"""Checkpoint conversion between Hugging Face safetensors (any supported family) and megatron-core torch_dist.

- `mapping`: the one HF <-> megatron name/layout table every tool uses.
- `hf_to_mcore.hf_to_mcore`, `mcore_to_hf.mcore_to_hf`: streamed converters (atomic output).
- `load.load_mcore`, `load.load_hf`: load weights into a model at the current parallel layout.
- `logits.forward_logits`: full-vocabulary logits at any layout, to check a conversion.
"""

from megatron_lora.convert.errors import ConversionError

__all__ = ["ConversionError"]
