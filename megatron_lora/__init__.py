"""megatron-lora: LoRA fine-tuning of Mixture-of-Experts models with megatron-core."""

__version__ = "0.1.0"

from megatron_lora.runtime import lean_import as _lean_import

_lean_import.install()  # before anything imports megatron-core (see the module's docstring)
