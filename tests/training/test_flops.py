"""training/flops.py: the model FLOPs of a LoRA step counted by hand, matmul by matmul, at tiny
shapes (frozen weights: forward + input gradient only; adapters: all three products; attention:
the causal half), the peak table, and a `train` run whose metrics.jsonl holds the TFLOP/s that
its tokens/s and the FLOPs per token give."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_lora.lora.model import LoraConfig
from megatron_lora.models.gpt import ModelShape
from megatron_lora.training.flops import (bf16_peak_tflops, device_peak, lora_step_flops,
                                          run_step_flops)
from megatron_lora.training.loop import RunConfig

# h 8, 2 heads of 4 (d_attn 8), 1 KV group (kv 4), 4 experts top-2 of ffn 12, vocab 16.
SHAPE = ModelShape(vocab_size=16, hidden_size=8, ffn_hidden_size=12, num_layers=2,
                   num_attention_heads=2, num_query_groups=1, num_experts=4, moe_router_topk=2,
                   max_position_embeddings=16)
S, ROWS = 4, 3
T = S * ROWS  # tokens of the step
R = 2
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def mm(m, n, k):
    """FLOPs of an [m, k] x [k, n] product."""
    return 2 * m * n * k


def base_forward_matmuls():
    """(m, n, k) of every base linear's forward in one layer: m tokens (an expert's: the
    tokens routed to it, 2T visits over the 4 experts), n = out, k = in."""
    return [
        (T, 8 + 2 * 4, 8),  # linear_qkv: h -> q (2 heads x 4) + k, v (1 group x 4 each)
        (T, 8, 8),          # linear_proj: d_attn -> h
        (T, 4, 8),          # router: h -> 4 expert logits
        (2 * T, 2 * 12, 8),  # linear_fc1 (gate and up) of the 2 experts each token visits
        (2 * T, 8, 12),     # linear_fc2
    ]


def attention_forward():
    """QK^T and AV of one layer: per row and head an [s, 4] x [4, s] and an [s, s] x [s, 4],
    of which the causal half (s * s / 2 scores) is counted."""
    per_head = mm(S, S, 4) / 2 + mm(S, 4, S) / 2
    return ROWS * 2 * per_head


def lora_matmuls(m, n_in, n_out, r):
    """One adapted linear: u = x A^T [m, r], y = u B^T [m, out]; backward: dB = dy^T u,
    du = dy B, dA = du^T x, dx = du A."""
    return [(m, r, n_in), (m, n_out, r), (n_out, r, m), (m, r, n_out), (r, n_in, m),
            (m, n_in, r)]


def hand_count(full=False, r=R):
    output_layer = mm(T, 16, 8)
    base = sum(mm(*x) for x in base_forward_matmuls()) * SHAPE.num_layers + output_layer
    # forward and the input gradient (the same m x n x k); a weight gradient only when trained
    linears = base * (3 if full else 2)
    attention = attention_forward() * 3 * SHAPE.num_layers  # forward, dQ and dK, dP and dV
    adapters = 0
    if not full:
        per_layer = (lora_matmuls(T, 8, 16, r) + lora_matmuls(T, 8, 8, r)
                     + lora_matmuls(2 * T, 8, 24, r) + lora_matmuls(2 * T, 12, 8, r))
        adapters = sum(mm(*x) for x in per_layer) * SHAPE.num_layers
    return linears + attention + adapters


def test_lora_step_matches_the_matmuls_counted_by_hand():
    count = lora_step_flops(SHAPE, LoraConfig(r=R, lora_alpha=4, target_modules=TARGETS), S, T)
    assert count.total == hand_count()
    assert count.base_weight_grad == 0  # the frozen base: no weight gradient
    assert count.per_token == hand_count() / T


def test_a_dense_layer_between_moe_layers_counts_its_own_mlp():
    """Layer 0 a dense SwiGLU MLP of ffn 10 (every token, no router), layer 1 MoE."""
    import dataclasses

    shape = dataclasses.replace(SHAPE, moe_layer_pattern=(0, 1), dense_ffn_hidden_size=10)
    count = lora_step_flops(shape, LoraConfig(r=R, lora_alpha=4, target_modules=TARGETS), S, T)
    dense = [(T, 8 + 2 * 4, 8), (T, 8, 8), (T, 2 * 10, 8), (T, 8, 10)]
    base = (sum(mm(*x) for x in dense) + sum(mm(*x) for x in base_forward_matmuls())
            + mm(T, 16, 8))
    adapters = (lora_matmuls(T, 8, 16, R) + lora_matmuls(T, 8, 8, R)) * 2 + (
        lora_matmuls(T, 8, 20, R) + lora_matmuls(T, 10, 8, R)
        + lora_matmuls(2 * T, 8, 24, R) + lora_matmuls(2 * T, 12, 8, R))
    want = 2 * base + attention_forward() * 3 * 2 + sum(mm(*x) for x in adapters)
    assert count.total == want


def test_multi_latent_attention_matmuls_counted_by_hand():
    """DeepSeek-V3's attention on SHAPE's MoE layers: 2 heads, q_lora_rank 6, kv_lora_rank 4,
    nope 4, rope 2 (q/k heads of 6), v heads of 3. Its linears per layer: q down h -> 6, q up
    6 -> 2 x 6, kv down h -> 4 + 2, kv up 4 -> 2 x (4 + 3), linear_proj 2 x 3 -> h; attention
    QK^T over 6 channels and AV over 3 per head. LoRA's linear_qkv adapts each q/kv projection
    (here kv up at its own rank 4 by rank_pattern), linear_proj the output [h, 6]. Without
    q_lora_rank one q projection h -> 12."""
    import dataclasses

    from megatron_lora.families.shape import MlaShape

    mla = MlaShape(q_lora_rank=6, kv_lora_rank=4, qk_head_dim=4, qk_pos_emb_head_dim=2,
                   v_head_dim=3)
    shape = dataclasses.replace(SHAPE, num_query_groups=2, mla=mla)
    per_head = mm(S, S, 6) / 2 + mm(S, 3, S) / 2  # causal halves of QK^T and AV
    attention = ROWS * 2 * per_head * 3 * 2  # 2 heads; forward and backward; 2 layers
    lora = LoraConfig(r=R, lora_alpha=4, target_modules=TARGETS,
                      rank_pattern={"linear_kv_up_proj": 4})
    for q_lora_rank, q in ((6, [(T, 6, 8), (T, 12, 6)]), (None, [(T, 12, 8)])):
        variant = dataclasses.replace(shape, mla=dataclasses.replace(mla, q_lora_rank=q_lora_rank))
        linears = q + [(T, 6, 8), (T, 14, 4), (T, 8, 6)]  # kv down, kv up, linear_proj
        base = sum(mm(*x) for x in linears + base_forward_matmuls()[2:]) * 2 + mm(T, 16, 8)
        adapters = [x for m, n_out, n_in in q + [(T, 6, 8), (T, 8, 6)]  # q, kv down, proj
                    for x in lora_matmuls(m, n_in, n_out, R)]
        adapters += lora_matmuls(T, 4, 14, 4)  # kv up at rank 4
        adapters += lora_matmuls(2 * T, 8, 24, R) + lora_matmuls(2 * T, 12, 8, R)
        count = lora_step_flops(variant, lora, S, T)
        assert count.total == 2 * base + attention + sum(mm(*x) for x in adapters) * 2
        assert lora_step_flops(variant, None, S, T).total == 3 * base + attention


def test_full_fine_tuning_counts_every_weight_gradient():
    count = lora_step_flops(SHAPE, None, S, T)
    assert count.total == hand_count(full=True)
    assert count.base_weight_grad == count.base_forward == count.base_input_grad
    assert count.adapters == 0


def test_rank_pattern_gives_a_kind_its_own_rank():
    config = LoraConfig(r=R, lora_alpha=4, target_modules=TARGETS, rank_pattern={"experts": 4})
    count = lora_step_flops(SHAPE, config, S, T)
    experts = lambda r: sum(mm(*x) for x in lora_matmuls(2 * T, 8, 24, r)  # noqa: E731
                            + lora_matmuls(2 * T, 12, 8, r)) * SHAPE.num_layers
    assert count.total == hand_count() - experts(R) + experts(4)


def test_prefix_tuning_counts_the_virtual_keys_and_the_projection():
    n, enc = 3, 5
    plain = lora_step_flops(SHAPE, LoraConfig(num_virtual_tokens=n, target_modules=()), S, T)
    # Each query (2 heads of 4) scores n more keys and mixes n more values: forward, 2 x back.
    prefix_attention = 3 * (mm(T, n, 4) + mm(T, 4, n)) * 2 * SHAPE.num_layers
    frozen = hand_count(full=True) - sum(mm(*x) for x in base_forward_matmuls()) \
        * SHAPE.num_layers - mm(T, 16, 8)  # no weight gradient
    assert plain.total == frozen + prefix_attention
    projected = lora_step_flops(SHAPE, LoraConfig(num_virtual_tokens=n, target_modules=(),
                                                  prefix_projection=True,
                                                  encoder_hidden_size=enc), S, T,
                                micro_batches=2)
    # per forward, every layer: tanh(E [n, 4] W1^T [4, enc]) then W2 [enc -> 2 x 4], x 3
    projection = 3 * (mm(n, enc, 4) + mm(n, 2 * 4, enc)) * SHAPE.num_layers
    assert projected.per_forward == 2 * projection
    assert projected.total == plain.total + 2 * projection


def test_trainable_tokens_and_output_layer_lora():
    rows = lora_step_flops(SHAPE, LoraConfig(r=R, lora_alpha=4, target_modules=TARGETS,
                                             trainable_token_indices=[3, 5]), S, T)
    # logits of the 2 rows: x [T, 8] x delta^T [8, 2]: forward, input and row gradients
    assert rows.total == hand_count() + 3 * mm(T, 2, 8)
    head = lora_step_flops(SHAPE, LoraConfig(r=R, lora_alpha=4,
                                             target_modules=TARGETS + ["output_layer"]), S, T)
    assert head.total == hand_count() + sum(mm(*x) for x in lora_matmuls(T, 8, 16, R))
    assert head.base_weight_grad == 0  # the adapted output layer's base weight stays frozen


def test_run_step_flops_is_one_global_batch():
    run = RunConfig(micro_batch_size=2, global_batch_size=6, seq_length=S, train_iters=1)
    dora = LoraConfig(r=R, lora_alpha=4, target_modules=["linear_proj"], use_dora=True)
    count = run_step_flops(SHAPE, dora, run)
    assert (count.tokens, count.micro_batches) == (6 * S, 3)
    # DoRA's row norms ||W + s B A|| of both layers' [8, 8] proj, once per forward
    assert count.per_forward == 3 * SHAPE.num_layers * (mm(8, 8, R) + 2 * 8 * 8)


def test_peak_table_names_and_cpu_has_no_mfu():
    assert bf16_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert bf16_peak_tflops("NVIDIA H200") == 989.0
    assert bf16_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert bf16_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert bf16_peak_tflops("NVIDIA A10") == 125.0 and bf16_peak_tflops("NVIDIA L4") == 121.0
    assert bf16_peak_tflops("NVIDIA L40") is None and bf16_peak_tflops("Tesla T4") is None
    peak, note = device_peak(torch.device("cpu"), bf16=True)
    assert peak is None and "no MFU on cpu" in note


def test_train_logs_tflops_consistent_with_tokens_per_s(tmp_path, tiny_example):
    from megatron_lora.families import read_hf_config

    seq, gbs = 32, 2
    tiny = tiny_example(tmp_path / "tiny", samples=4)
    words = ["alpha", "beta", "gamma", "delta", "omega"]
    with open(tmp_path / "long.jsonl", "w") as f:  # every row one truncated sample: no padding
        for i in range(8):
            f.write(json.dumps({"text": " ".join(words[(i + j) % 5] for j in range(12))}) + "\n")
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               MASTER_PORT=str(29450 + os.getpid() % 100))
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(k, None)
    save = str(tmp_path / "run")
    out = subprocess.run(
        [sys.executable, "-m", "megatron_lora", "train", "--load-hf", os.path.join(tiny, "hf"),
         "--data-path", str(tmp_path / "long.jsonl"), "--tokenizer", "byte",
         "--seq-length", str(seq), "--micro-batch-size", "1", "--global-batch-size", str(gbs),
         "--train-iters", "2", "--lr", "1e-3", "--lora-rank", "4", "--lora-alpha", "8",
         "--lora-target-modules", "linear_qkv", "linear_proj", "--save", save],
        capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    info = read_hf_config(os.path.join(tiny, "hf"))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["linear_qkv", "linear_proj"])
    per_token = lora_step_flops(info.shape, lora, seq, gbs * seq, micro_batches=gbs).per_token
    assert f"{per_token:.4g} per token" in out.stdout and "no MFU on cpu" in out.stdout
    records = [json.loads(line) for line in open(os.path.join(save, "metrics.jsonl"))]
    assert [r["iteration"] for r in records] == [1, 2]
    for r in records:
        assert r["tflops"] > 0 and "mfu" not in r
        # every position is a target here, so tokens/s counts every position the step computes
        # fp64 on both sides (the log keeps every digit), each a few roundings of 2**-53 in
        # another order: 1e-14 is 90 of them
        assert r["tflops"] == pytest.approx(r["tokens/s"] * per_token / 1e12, rel=1e-14)
    shown = re.findall(r"tokens/s: (\d+) \| TFLOP/s per device: ([0-9.e+-]+) \|", out.stdout)
    assert len(shown) == 2


def test_the_worked_example_of_the_docs_is_the_function():
    """docs/training.md's Mixtral 8x7B numbers (s 4096, LoRA r=16 on q, k, v, o and every
    expert's fc1/fc2) are what lora_step_flops returns."""
    shape = ModelShape(vocab_size=32000, hidden_size=4096, ffn_hidden_size=14336, num_layers=32,
                       num_attention_heads=32, num_query_groups=8, num_experts=8,
                       moe_router_topk=2)
    lora = lora_step_flops(shape, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS),
                           4096, 4096, micro_batches=1)
    full = lora_step_flops(shape, None, 4096, 4096, micro_batches=1)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "training.md")) as f:
        section = f.read().split("### Model TFLOP/s and MFU", 1)[1].split("\n## ", 1)[0]
    numbers = {int(x.replace(",", "")) for x in re.findall(r"\d{1,3}(?:,\d{3})+", section)}
    per_token = {k: v / 4096 for k, v in lora.parts().items()}
    assert per_token["base_forward"] == per_token["base_input_grad"] == 25_497_174_016
    assert per_token["attention"] == 3_221_225_472 and per_token["adapters"] == 371_195_904
    assert (lora.per_token, full.per_token) == (54_586_769_408, 79_712_747_520)
    assert {25_497_174_016, 3_221_225_472, 371_195_904, 54_586_769_408,
            79_712_747_520, 12_748_587_008} <= numbers
