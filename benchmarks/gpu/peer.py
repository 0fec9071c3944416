"""The tool users would pick instead, timed at check.py's shapes: Hugging Face transformers + PEFT.

    from benchmarks.gpu.peer import time_peer
    time_peer("mixtral-8x7b", shape, seq=4096, steps=10, warmup=3, device=cuda, dtype=bf16)

Builds transformers' own model class for the shape (MixtralForCausalLM, Qwen3MoeForCausalLM)
with check.py's layer count and sizes, on the device, in bf16, with SDPA attention, and times
one [1, seq] row per step as check.py times ours:
    frozen  only the final norm trains (backward never enters the decoder layers)
    floor   frozen, with the embedding's output requiring grad: backward runs through every
            decoder layer, input gradients only (check.py's floor)
    lora    PEFT LoRA r=16, alpha 32 on q_proj/k_proj/v_proj/o_proj, and PEFT's
            `target_parameters` on the fused expert tensors (mlp.experts.gate_up_proj,
            mlp.experts.down_proj): the same adapters as ours on linear_qkv/linear_proj/fc1/fc2
    full    every parameter trains
Optimizer: torch AdamW (fused on CUDA, foreach on CPU), lr 1e-5; the step is forward, backward,
optimizer step, zero_grad(set_to_none). Each mode: the best of `steps` after `warmup`, CUDA
synchronised, and the peak memory of the step. Shapes transformers has no class for here
(DeepSeek-V3: 256 experts with group routing) report nothing.
"""

from __future__ import annotations

import gc
import time
from typing import Dict, Optional

PEER_MODES = ("frozen", "floor", "lora", "full")


def hf_model(name: str, shape: dict):
    """transformers' model for check.py's `shape` (None when the shape has no peer here)."""
    common = dict(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                  num_hidden_layers=shape["num_layers"],
                  num_attention_heads=shape["num_attention_heads"],
                  num_key_value_heads=shape["num_query_groups"],
                  num_experts_per_tok=shape["moe_router_topk"],
                  max_position_embeddings=shape["max_position_embeddings"],
                  rope_theta=shape["rotary_base"], rms_norm_eps=shape["norm_epsilon"],
                  tie_word_embeddings=False, attn_implementation="sdpa")
    if name.startswith("mixtral"):
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM, MixtralConfig(
            intermediate_size=shape["ffn_hidden_size"], num_local_experts=shape["num_experts"],
            **common)
    if name.startswith("qwen3"):
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        head_dim = shape.get("kv_channels") or shape["hidden_size"] // shape["num_attention_heads"]
        return Qwen3MoeForCausalLM, Qwen3MoeConfig(
            moe_intermediate_size=shape["ffn_hidden_size"], num_experts=shape["num_experts"],
            head_dim=head_dim, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            **common)
    return None


def _peft_lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))


def _time_mode(cls, config, mode: str, seq: int, steps: int, warmup: int, device, dtype) -> dict:
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with torch.device(device):
        model = cls(config).to(dtype)
    if mode == "lora":
        model = _peft_lora(model)
    elif mode in ("frozen", "floor"):
        for name, p in model.named_parameters():
            p.requires_grad = name == "model.norm.weight"
        if mode == "floor":  # the decoder's input requires grad: backward enters every layer
            model.get_input_embeddings().register_forward_hook(
                lambda module, inputs, out: out.detach().requires_grad_(True))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=cuda, foreach=not cuda or None)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, config.vocab_size, (1, seq), generator=gen).to(device)
    times = []
    for step in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    best = min(times)
    result = {"ms_per_step": round(best * 1e3, 2),
              "mean_ms_per_step": round(sum(times) / len(times) * 1e3, 2),
              "tokens_per_s": round(seq / best, 1),
              "peak_memory_bytes": int(torch.cuda.max_memory_allocated()) if cuda else None,
              "trainable_parameters": sum(p.numel() for p in params)}
    del model, optimizer, params, loss
    gc.collect()
    return result


def time_peer(name: str, shape: dict, *, seq: int, steps: int, warmup: int, device, dtype,
              modes=PEER_MODES) -> Optional[Dict[str, dict]]:
    """{mode: timing} of transformers + PEFT at `shape`, or None when there is no peer (or
    transformers / PEFT are not installed: then {"error": why})."""
    try:
        built = hf_model(name, shape)
    except ImportError as exc:
        return {"error": f"transformers: {exc}"}
    if built is None:
        return None
    cls, config = built
    out = {}
    for mode in modes:
        try:
            out[mode] = _time_mode(cls, config, mode, seq, steps, warmup, device, dtype)
        except ImportError as exc:  # PEFT missing: the other modes still run
            out[mode] = {"error": f"{type(exc).__name__}: {exc}"}
    return out
