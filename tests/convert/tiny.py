"""A tiny random Mixtral made and run by Hugging Face transformers: the oracle for conversion.

GQA (4 heads, 2 KV heads), 4 experts, top-2, untied embeddings, a vocabulary (250) that megatron
pads (to 256), saved as several safetensors shards with an index.
"""

import json
import os

import torch

TINY_CONFIG = dict(
    vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    max_position_embeddings=128, rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False,
    initializer_range=0.1,
)


def make_tiny_mixtral(directory: str, seed: int = 0, **overrides) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**dict(TINY_CONFIG, **overrides))).float()
    model.save_pretrained(directory, max_shard_size="200KB")
    assert os.path.exists(os.path.join(directory, "model.safetensors.index.json"))


def hf_logits(directory: str, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' eager fp32 logits [B, S, V] of the checkpoint in `directory`."""
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(
        directory, attn_implementation="eager", experts_implementation="eager",
        dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def make_tokens(batch: int = 4, seq: int = 16, vocab: int = 250, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def write_tokens(path: str, tokens: torch.Tensor) -> None:
    with open(path, "w") as f:
        json.dump(tokens.tolist(), f)
