"""benchmarks/gpu/modes.py: the FLOPs each mode of the GPU check runs, pinned by hand on a tiny
shape, and what backward reaches in each mode (frozen: no decoder layer; floor and LoRA: every
one, floor down to the decoder's input)."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# One MoE layer: h 8, 2 heads of 4 (one KV group), 2 experts top-1 of ffn 4, vocab 16.
TINY = dict(vocab_size=16, hidden_size=8, ffn_hidden_size=4, num_layers=1,
            num_attention_heads=2, num_query_groups=1, num_experts=2, moe_router_topk=1,
            max_position_embeddings=8, rotary_base=1e6, norm_epsilon=1e-5)
SEQ = 4


def test_flops_per_token_by_hand():
    """Per token, by hand. MACs N of the linears a token visits: linear_qkv 8 -> (2 + 2) x 4 = 16:
    128; linear_proj 8 -> 8: 64; router 8 -> 2: 16; one expert's fc1 8 -> 2 x 4 (SwiGLU): 64 and
    fc2 4 -> 8: 32; output layer 8 -> 16: 128; N = 432. Attention forward A = QK^T and AV over
    s / 2 = 2 keys on average, 2 x 2 x 2 x 8 = 64. Adapters (r = 16) on qkv 16 x (8 + 16),
    proj 16 x (8 + 8), fc1 16 x (8 + 8), fc2 16 x (4 + 8): 1088 parameters, 6 FLOPs each."""
    from benchmarks.gpu.modes import flops_per_token

    n, a, h, v, adapters = 432, 64, 8, 16, 1088
    assert flops_per_token(TINY, SEQ, "frozen") == 2 * n + a + 2 * h * v == 1184
    assert flops_per_token(TINY, SEQ, "floor") == 4 * n + 3 * a == 1920
    assert flops_per_token(TINY, SEQ, "lora") == 4 * n + 3 * a + 6 * adapters == 8448
    assert flops_per_token(TINY, SEQ, "full") == 6 * n + 3 * a == 3 * (2 * n + a) == 2784
    # the sequential experts run the same model FLOPs
    for mode in ("frozen", "lora"):
        assert flops_per_token(TINY, SEQ, f"{mode}_sequential") == flops_per_token(TINY, SEQ, mode)


_SCRIPT = r"""
import json, os, socket, sys
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(port))
import torch
from benchmarks.gpu.check import SHAPE_TINY, build
from benchmarks.gpu.modes import prepare
from megatron_lora import runtime
from megatron_lora.runtime import ParallelLayout
from megatron_lora.training.optimizer import OptimConfig, wrap_for_training
from megatron_lora.training.step import forward_backward

runtime.initialize(ParallelLayout(), seed=1234)
device = runtime.device()
seen = {}
for mode in sys.argv[1:]:
    model = build(dict(SHAPE_TINY), True, torch.bfloat16, device)
    prepare(model, mode)
    fired, decoder_input = [], []
    for i, layer in enumerate(model.decoder.layers):
        layer.register_full_backward_hook(lambda m, gi, go, i=i: fired.append(i))
    model.embedding.register_forward_hook(lambda m, i, out: decoder_input.append(out))
    wrapped, _, _ = wrap_for_training(
        [model], OptimConfig(lr=1e-5, train_iters=10, lr_decay_style="constant"))
    rows = torch.randint(0, SHAPE_TINY["vocab_size"], (1, 17)).to(device)
    forward_backward(wrapped, rows[:, :-1], rows[:, 1:], micro_batch_size=1)
    seen[mode] = {"layers": len(model.decoder.layers), "fired": sorted(fired),
                  "decoder_input_grad": decoder_input[0].grad is not None,
                  "trainable": sorted(n for n, p in model.named_parameters()
                                      if p.requires_grad and "lora" not in n)}
runtime.shutdown()
print(json.dumps(seen))
"""


def test_floor_backward_enters_every_decoder_layer_frozen_none():
    """A full backward hook on each decoder layer: frozen fires none (backward stops at the final
    norm), floor fires every one and gives the decoder's input (the embedding's output) a
    gradient, so each layer ran its input gradient; LoRA fires every one too. Floor trains what
    frozen trains (the final norm) and no other weight."""
    out = subprocess.run([sys.executable, "-c", _SCRIPT, "frozen", "floor", "lora"],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                                  PYTHONPATH=os.pathsep.join(
                                      [REPO, os.environ.get("PYTHONPATH", "")])))
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    layers = list(range(seen["floor"]["layers"]))
    assert len(layers) == 2
    assert seen["frozen"]["fired"] == [] and not seen["frozen"]["decoder_input_grad"]
    assert seen["floor"]["fired"] == layers and seen["floor"]["decoder_input_grad"]
    assert seen["lora"]["fired"] == layers
    assert seen["floor"]["trainable"] == seen["frozen"]["trainable"] == \
        ["decoder.final_layernorm.weight"]
    assert seen["lora"]["trainable"] == []  # the adapters only
