"""The KV-cache engine against plain autograd-free recomputation: greedy tokens equal the argmax
of a full forward of the whole sequence at every step (no cache), generation stops at EOS
(returned, as transformers returns it), and sampling follows the seed. One rank; the layouts are
covered against transformers + PEFT in tests/export/test_generate.py."""

import torch

from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank


@multirank(world_size=1, timeout=300)
def test_cache_greedy_eos_and_seeded_sampling(layout=ParallelLayout()):
    from megatron_lora.inference import SamplingConfig, generate
    from megatron_lora.lora.model import LoraConfig, apply_lora
    from megatron_lora.models.gpt import build_gpt_model, tiny_moe_shape, transformer_config

    shape = tiny_moe_shape()
    model = build_gpt_model(shape, transformer_config(shape, layout), attention_backend="flash")
    apply_lora(model, LoraConfig(r=4, lora_alpha=8.0, init_lora_weights=False, seed=5,
                                 target_modules=["linear_qkv", "linear_fc1", "router"]),
               verbose=False)
    model.eval()
    prompt = [3, 141, 59, 26, 53]
    out = generate(model, prompt, SamplingConfig(max_new_tokens=8), eos_id=None,
                   vocab_size=shape.vocab_size)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):  # the reference: the whole sequence each step, no cache
            logits = model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0),
                           attention_mask=None)
            ids.append(int(logits[0, -1, :shape.vocab_size].argmax()))
    assert out == ids[len(prompt):]
    assert len(set(out)) > 1

    stop = generate(model, prompt, SamplingConfig(max_new_tokens=8), eos_id=out[2],
                    vocab_size=shape.vocab_size)
    assert stop == out[:out.index(out[2]) + 1]

    hot = SamplingConfig(max_new_tokens=8, temperature=1.5, seed=11)
    draws = [generate(model, prompt, hot, eos_id=None, vocab_size=shape.vocab_size)
             for _ in range(2)]
    assert draws[0] == draws[1] and draws[0] != out
