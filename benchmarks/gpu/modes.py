"""What each mode of benchmarks/gpu/check.py trains, and the model FLOPs it really runs.

    frozen   the base frozen but the final norm: backward starts at the loss and stops at the
             final norm (it never enters a decoder layer): a forward plus the output layer's
             input gradient
    floor    frozen, with the decoder's input (the embedding's output) requiring grad: backward
             runs through every decoder layer computing input gradients only, no weight
             gradient, an optimizer step over the final norm only: what a LoRA step's backward
             costs without adapters, the floor a LoRA step can approach
    lora     LoRA r=16 (alpha 32) on linear_qkv, linear_proj and every expert's fc1/fc2
    dora     the LoRA of `lora` with DoRA
    prefix   prefix tuning, 20 virtual tokens per layer
    qlora    the LoRA of `lora` on a base whose decoder linears are NF4 (check.py quantises it)
    full     every parameter trained
(`_sequential`: the same mode on megatron's SequentialMLP experts.)

FLOPs per token (`flops_per_token`), from the parts of training/flops.py's lora_step_flops (what
`train` logs), N the multiply-accumulates of the base linears a token visits (attention linears,
router, top-k experts, output layer h x V), A the attention's QK^T and AV forward (2 s d_attn
per layer: causal half; multi-latent attention: s n (nope + rope + v)):
    frozen   2 N + A + 2 h V              forward, the output layer's input gradient
    floor    4 N + 3 A                    forward, input gradients through every layer
    lora     4 N + 3 A + 6 adapters       floor + the adapters' forward, input and weight
             (+ per-forward work)         gradients (dora, prefix, qlora alike; qlora's
                                          dequantisation is not model work)
    full     6 N + 3 A                    3 x the forward
lora counts the first layer's input gradient, which autograd skips there (nothing before the
first layer requires grad): an overcount of 2 x its linear_qkv's MACs per token, about 1% of
the step at the check's shapes (lora_step_flops counts it so too).
"""

from __future__ import annotations

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
ADAPTER_MODES = ("lora", "dora", "prefix", "qlora")


def base_mode(mode: str) -> str:
    """The mode without its `_sequential` suffix."""
    return mode.replace("_sequential", "")


def mode_config(mode: str):
    """The LoraConfig a mode trains (None: full fine-tuning; frozen and floor: lora's, whose
    adapters they leave out); on multi-latent attention linear_qkv adapts each q/kv down and
    up projection."""
    from megatron_lora.lora.model import LoraConfig

    mode = base_mode(mode)
    if mode == "qlora":  # the LoRA of `lora`, on an NF4 base
        mode = "lora"
    if mode == "full":
        return None
    if mode == "prefix":
        return LoraConfig(num_virtual_tokens=20, target_modules=())
    return LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, use_dora=mode == "dora")


def flops_per_token(shape: dict, seq: int, mode: str) -> float:
    """Model FLOPs per token of one step of `mode` on one [1, seq] row (module docstring)."""
    from megatron_lora.models.gpt import ModelShape
    from megatron_lora.training.flops import lora_step_flops

    model_shape = ModelShape(**shape)
    count = lora_step_flops(model_shape, mode_config(mode), seq, seq, micro_batches=1)
    forward = count.base_forward + count.attention / 3  # attention: forward + 2 x backward
    mode = base_mode(mode)
    if mode == "frozen":
        output_input_grad = 2.0 * model_shape.hidden_size * model_shape.vocab_size * seq
        return (forward + output_input_grad) / seq
    if mode == "floor":
        return (count.base_forward + count.base_input_grad + count.attention) / seq
    return count.per_token


def prepare(model, mode: str) -> None:
    """Set up `model` (a GPTModel, built, not yet wrapped) to train `mode`: adapters applied,
    or the base frozen but for the final norm (frozen, floor), floor also making the embedding's
    output require grad so that backward enters every decoder layer."""
    from megatron_lora.lora.input_grad import require_decoder_input_grad
    from megatron_lora.lora.model import apply_lora

    mode = base_mode(mode)
    if mode in ADAPTER_MODES:
        apply_lora(model, mode_config(mode), verbose=False)
    elif mode in ("frozen", "floor"):
        for name, p in model.named_parameters():
            p.requires_grad = name.startswith("decoder.final_layernorm")
        if mode == "floor" and not require_decoder_input_grad(model):
            raise ValueError("floor: the model has no embedding to make its output require grad")
    elif mode != "full":
        raise ValueError(f"unknown mode {mode!r}")
