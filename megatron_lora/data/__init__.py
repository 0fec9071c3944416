"""Training data: tokenizers, JSONL samples (causal LM and SFT), packing, deterministic batches."""

from megatron_lora.data.batches import Batch, PackedDataset
from megatron_lora.data.jsonl import DataError, Sample, read_jsonl
from megatron_lora.data.packing import pack_samples
from megatron_lora.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "Batch", "ByteTokenizer", "DataError", "HFTokenizer", "PackedDataset", "Sample",
    "load_tokenizer", "pack_samples", "read_jsonl",
]
