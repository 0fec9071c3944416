"""megatron-lora: LoRA fine-tuning of Mixture-of-Experts models with megatron-core."""

__version__ = "0.1.0"
