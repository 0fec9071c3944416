"""tools/memory_estimate.py reads any supported family's config.json: its weights count equals
the published parameter totals (Mixtral 8x7B: 46.7B; Qwen3-30B-A3B: 30.5B; Qwen3-235B-A22B:
235B; GLM-4.5-Air: 106B, its dense first layer counted with its own MLP; gpt-oss-20b: 20.91B;
gpt-oss-120b: 116.83B, with their biases and sinks) at one GPU, shrinks as the layout shards it,
and counts a shared expert; the tables of examples/glm4_moe/README.md are the output of the
commands shown above them."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from megatron_lora.runtime import ParallelLayout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _estimate():
    spec = importlib.util.spec_from_file_location(
        "memory_estimate", os.path.join(ROOT, "tools", "memory_estimate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.estimate


def _config(name):
    return json.load(open(os.path.join(ROOT, "examples", name)))


@pytest.mark.parametrize("config,billions", [("mixtral_8x7b/config.json", 46.7),
                                             ("qwen3_moe/config_30b_a3b.json", 30.5),
                                             ("qwen3_moe/config_235b_a22b.json", 235.1),
                                             ("glm4_moe/config.json", 106.0),
                                             ("gpt_oss/config_20b.json", 20.91),
                                             ("gpt_oss/config_120b.json", 116.83)])
def test_weights_at_one_gpu_are_the_published_parameter_count(config, billions):
    e = _estimate()(_config(config), ParallelLayout(), 1, 4096, 1, 16)
    rel = 1e-3 if config.startswith("gpt_oss") else 0.01  # exact counts published
    assert e["weights"] / 2 / 1e9 == pytest.approx(billions, rel=rel)  # bf16: 2 bytes each
    sharded = _estimate()(_config(config), ParallelLayout(tp=2, ep=4, sp=True), 8, 4096, 1, 16)
    assert sharded["weights"] < e["weights"] / 4 and sharded["activations"] < e["activations"]


def test_a_shared_expert_adds_its_weights_and_adapters():
    # Qwen3's sizes with head_dim = hidden / heads (what Qwen2-MoE has), without and with a
    # shared expert of 2048
    base = dict(_config("qwen3_moe/config_30b_a3b.json"), head_dim=64)
    qwen2 = dict(base, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                 shared_expert_intermediate_size=2048, qkv_bias=False)
    qwen2.pop("head_dim")
    plain = _estimate()(qwen2, ParallelLayout(), 1, 4096, 1, 16)
    ref = _estimate()(base, ParallelLayout(), 1, 4096, 1, 16)
    h, fs, layers = 2048, 2048, 48
    assert plain["weights"] - ref["weights"] == pytest.approx(2 * layers * (3 * h * fs + h))
    assert plain["adapters"] - ref["adapters"] == pytest.approx(
        2 * layers * 16 * ((h + 2 * fs) + (fs + h)))


def test_nf4_base_holds_the_decoder_linears_at_half_a_byte():
    # Mixtral 8x7B: per layer q, k, v, o (h (n + 2 g) d + n d h) and 8 experts x 3 h f
    h, n, g, d, f, layers, experts = 4096, 32, 8, 128, 14336, 32, 8
    linears = layers * (h * (n + 2 * g) * d + n * d * h + experts * 3 * h * f)
    nf4_bytes = 0.5 + 1 / 64 + 4 / 16384  # codes, uint8 block scales, fp32 per 256 scales
    for layout in (ParallelLayout(), ParallelLayout(tp=2, ep=4, sp=True)):
        bf16 = _estimate()(_config("mixtral_8x7b/config.json"), layout, 8, 4096, 1, 16)
        nf4 = _estimate()(_config("mixtral_8x7b/config.json"), layout, 8, 4096, 1, 16,
                          base_quantization="nf4")
        if layout.tp == 1 and layout.ep == 1:  # one GPU: every linear parameter 2 -> 0.516 B
            assert bf16["weights"] - nf4["weights"] == pytest.approx(
                linears * (2 - nf4_bytes), rel=1e-9)
        assert nf4["weights"] < bf16["weights"] * 0.3  # the bf16 embeddings are the rest
        assert {k: v for k, v in nf4.items() if k != "weights"} == \
            {k: v for k, v in bf16.items() if k != "weights"}


def test_the_glm_readme_tables_are_the_output_of_its_commands():
    readme = open(os.path.join(ROOT, "examples", "glm4_moe", "README.md")).read()
    commands = re.findall(r"```sh\n(python tools/memory_estimate.py [^\n]*)\n```", readme)
    assert len(commands) == 3, commands
    for command in commands:
        out = subprocess.run([sys.executable, *command.split()[1:]], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
        rows = [line for line in out.splitlines() if line.startswith("| ")]
        assert len(rows) >= 2 and all(row in readme for row in rows), (command, out)


def test_a_dense_first_layer_is_counted_with_its_own_mlp():
    # GLM-4.5-Air with layer 0 dense against every layer MoE: one layer's experts, router and
    # shared expert fewer, one dense MLP of intermediate_size more
    air = _config("glm4_moe/config.json")
    h, f, F, E = 4096, 1408, 10944, 128
    dense = _estimate()(air, ParallelLayout(), 1, 4096, 1, 16)
    moe = _estimate()(dict(air, first_k_dense_replace=0), ParallelLayout(), 1, 4096, 1, 16)
    assert moe["weights"] - dense["weights"] == pytest.approx(
        2 * (E * 3 * h * f + E * h + 3 * h * f - 3 * h * F))
    r = 16
    assert moe["adapters"] - dense["adapters"] == pytest.approx(
        2 * ((E + 1) * r * (2 * h + 3 * f) - r * (2 * h + 3 * F)))
