"""Inference with (or without) LoRA adapters: KV-cache generation at any parallel layout."""

from megatron_lora.inference.generate import generate
from megatron_lora.inference.sampling import SamplingConfig, next_token

__all__ = ["SamplingConfig", "generate", "next_token"]
