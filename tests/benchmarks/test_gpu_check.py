"""benchmarks/gpu/check.py, the one-shot GPU check, runs end to end on CPU with tiny shapes
(`--tiny`): every mode trains through megatron-lora's own stack and the JSON line holds every
field the GPU run reports, with values that agree with each other."""

import json
import os
import subprocess
import sys

import pytest

from megatron_lora.runtime import ParallelLayout

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# summary key -> the two modes whose ms per step it divides
RATIOS = {"dora_over_lora": ("dora", "lora"), "prefix_over_lora": ("prefix", "lora"),
          "lora_over_frozen": ("lora", "frozen"), "lora_over_floor": ("lora", "floor"),
          "floor_over_frozen": ("floor", "frozen"), "lora_over_full": ("lora", "full"),
          "grouped_over_sequential_lora": ("lora", "lora_sequential")}


def _ratio_bound(a: float, b: float) -> float:
    """check.py divides the unrounded times and prints the ratio to 4 decimals (5e-5); the times
    it prints are rounded to 0.01 ms (a and b each within 0.005 of the true time), which moves
    a / b by at most (a / b) (0.005 / (a - 0.005) + 0.005 / (b - 0.005))."""
    return 5e-5 + (a / b) * (0.005 / (a - 0.005) + 0.005 / (b - 0.005))


def test_gpu_check_smoke_on_cpu():
    from benchmarks.gpu.modes import flops_per_token

    out = subprocess.run([sys.executable, "benchmarks/gpu/check.py", "--tiny", "--steps", "1",
                          "--no-peer"],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    modes = result["modes"]
    assert set(modes) == {"frozen", "floor", "lora", "full", "dora", "prefix", "lora_sequential",
                          "frozen_sequential"}
    assert result["skipped"] == []
    for name, mode in modes.items():
        assert mode["ms_per_step"] > 0 and mode["tokens_per_s"] > 0, name
        assert mode["mfu"] is None, name  # CPU: no peak, no MFU
        # the printed TFLOP/s is tokens/s x the FLOPs per token `train` logs with
        assert mode["flops_per_token"] == flops_per_token(_run_shape(result), 64, name)
        # tokens/s is printed to 0.1 (within 0.05) and the TFLOP/s to 6 significant digits
        # (5e-6 relative)
        tps = mode["tokens_per_s"]
        assert mode["model_tflops"] == pytest.approx(
            tps * mode["flops_per_token"] / 1e12, rel=0.05 / (tps - 0.05) + 5e-6), name
    trainable = {name: mode["trainable_parameters"] for name, mode in modes.items()}
    # frozen and floor train only the final norm; LoRA some; full everything.
    assert trainable["frozen"] == trainable["floor"] == result["shape"]["hidden_size"]
    assert trainable["frozen"] < trainable["lora"] < trainable["full"]
    assert trainable["lora"] == trainable["lora_sequential"]
    assert trainable["frozen"] < trainable["prefix"] < trainable["full"]
    assert trainable["lora"] < trainable["dora"] < trainable["full"]  # + the magnitudes
    ms = {name: mode["ms_per_step"] for name, mode in modes.items()}
    for key, (a, b) in RATIOS.items():
        want = ms[a] / ms[b]
        assert result[key] == pytest.approx(want, abs=_ratio_bound(ms[a], ms[b])), key
    flops = {name: mode["flops_per_token"] for name, mode in modes.items()}
    assert flops["frozen"] < flops["floor"] < flops["lora"] < flops["dora"]
    assert flops["lora"] < flops["full"] and flops["floor"] < flops["prefix"]
    assert flops["frozen_sequential"] == flops["frozen"]
    assert flops["lora_sequential"] == flops["lora"]


def _run_shape(result):
    """The model shape the run reports (the tiny sizes; positions grown to its sequence)."""
    return {k: v for k, v in result["shape"].items()
            if k not in ("seq_length", "dtype", "micro_batch_size")}


def test_gpu_check_counts_with_the_function_train_logs_with():
    """At 8x7B layer shapes (2 layers): the check's LoRA figure is lora_step_flops's, which is
    4 N + attention + 6 x the adapter parameters a token visits, 6 N + attention for full
    fine-tuning, N counting the router and only the top-2 experts; floor is LoRA's without the
    adapters, frozen a forward (a third of the attention) plus the output layer's input
    gradient."""
    from benchmarks.gpu.check import SHAPE_8X7B
    from benchmarks.gpu.modes import TARGETS, flops_per_token
    from megatron_lora.lora.model import LoraConfig
    from megatron_lora.models.gpt import ModelShape
    from megatron_lora.training.flops import lora_step_flops

    lora = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS)
    assert flops_per_token(SHAPE_8X7B, 4096, "lora") == lora_step_flops(
        ModelShape(**SHAPE_8X7B), lora, 4096, 4096, micro_batches=1).per_token
    h, kv, f, v = 4096, 1024, 14336, 32000
    n = 2 * (h * (h + 2 * kv) + h * h + h * 8 + 2 * 3 * h * f) + v * h
    attention = 6 * 4096 * h * 2
    adapters = 2 * 16 * ((h + h + 2 * kv) + (h + h) + 2 * ((h + 2 * f) + (f + h)))
    assert flops_per_token(SHAPE_8X7B, 4096, "full") == 6 * n + attention
    assert flops_per_token(SHAPE_8X7B, 4096, "lora") == 4 * n + attention + 6 * adapters
    assert flops_per_token(SHAPE_8X7B, 4096, "floor") == 4 * n + attention
    assert flops_per_token(SHAPE_8X7B, 4096, "frozen") == 2 * n + attention / 3 + 2 * h * v


def test_gpu_check_qwen3_shape_smoke_on_cpu(checked_run):
    """--shape qwen3-30b-a3b (tiny sizes with its quirks: head_dim != h/heads, q/k norms, top-4
    of 8 experts) times every mode, the sequential-expert pair included."""
    result = checked_run("qwen3-30b-a3b")
    assert result["shape_name"] == "qwen3-30b-a3b"
    assert set(result["modes"]) == {"frozen", "floor", "lora", "full", "dora", "prefix",
                                    "lora_sequential", "frozen_sequential"}
    assert result["dora_over_lora"] > 0 and result["prefix_over_lora"] > 0
    shape = result["shape"]
    assert shape["kv_channels"] * shape["num_attention_heads"] != shape["hidden_size"]
    assert shape["qk_layernorm"] and shape["num_experts"] == 8
    trainable = {name: mode["trainable_parameters"] for name, mode in result["modes"].items()}
    assert trainable["frozen"] < trainable["lora"] == trainable["lora_sequential"] < \
        trainable["full"]


def test_qwen3_30b_a3b_shape_is_its_config():
    """The check's Qwen3-30B-A3B sizes are what the family reads from its config.json."""
    from benchmarks.gpu.check import SHAPE_QWEN3_30B_A3B
    from megatron_lora.families import model_info

    config = json.load(open(os.path.join(REPO, "examples", "qwen3_moe", "config_30b_a3b.json")))
    shape = model_info(config).shape
    for key, value in SHAPE_QWEN3_30B_A3B.items():
        if key not in ("num_layers", "max_position_embeddings", "vocab_size"):
            assert getattr(shape, key) == value, key
    assert shape.vocab_size == SHAPE_QWEN3_30B_A3B["vocab_size"]  # already a multiple of 128


def test_gpu_check_nf4_mode_smoke_on_cpu():
    """`--base-quantization nf4` (what run.sh passes) adds `qlora`, the LoRA of `lora` on a base
    held in NF4. A smoke test, not a measurement: on CPU and tiny shapes it proves that the mode
    runs through quantize_base and the NF4 layers, and that its fields agree with `lora`'s (the
    same trainable adapters and model FLOPs, ~0.516 bytes held per NF4 parameter); its times say
    nothing about a GPU."""
    out = subprocess.run([sys.executable, "benchmarks/gpu/check.py", "--tiny", "--steps", "1",
                          "--base-quantization", "nf4", "--modes", "lora", "qlora", "--no-peer"],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert any(line.startswith("qlora ") for line in out.stdout.splitlines()), \
        out.stdout[-2000:]  # its table row
    result = json.loads(out.stdout.strip().splitlines()[-1])
    modes = result["modes"]
    assert result["base_quantization"] == "nf4" and set(modes) == {"lora", "qlora"}
    qlora, lora = modes["qlora"], modes["lora"]
    assert qlora["ms_per_step"] > 0 and qlora["tokens_per_s"] > 0 and qlora["mfu"] is None
    assert qlora["peak_memory_bytes"] is None  # CPU: no CUDA allocator to ask
    assert qlora["nf4_linears"] == 2 * (2 + 2 * result["shape"]["num_experts"])
    assert 0.5 < qlora["nf4_bytes_per_parameter"] <= 0.53
    assert "nf4_linears" not in lora
    assert qlora["trainable_parameters"] == lora["trainable_parameters"]
    assert qlora["flops_per_token"] == lora["flops_per_token"]
    a, b = qlora["ms_per_step"], lora["ms_per_step"]
    assert result["qlora_over_lora"] == pytest.approx(a / b, abs=_ratio_bound(a, b))
    assert result["lora_over_frozen"] is None  # frozen was not timed



def test_gpu_check_deepseek_v3_shape_smoke_on_cpu(checked_run):
    """--shape deepseek-v3 at tiny sizes (multi-latent attention with q_lora_rank, 16 experts
    top-4 in 4 groups of which 2 are kept, sigmoid scores with the expert bias, a shared expert,
    YaRN) times frozen, floor and lora. The model built is MLA's and the LoRA is on each
    q/kv projection (linear_qkv), linear_proj and every routed and shared fc1/fc2: their
    parameters counted by hand."""
    from benchmarks.gpu.modes import flops_per_token

    result = checked_run("deepseek-v3")
    assert result["shape_name"] == "deepseek-v3"
    assert set(result["modes"]) == {"frozen", "floor", "lora"}
    assert result["lora_over_full"] is None and result["lora_over_frozen"] > 0
    frozen, lora = result["modes"]["frozen"], result["modes"]["lora"]
    h, v, f, experts, layers, r = 64, 256, 96, 16, 2, 16  # the shared expert's ffn is f too
    # q down 24 x h, q up (4 x 12) x 24, kv down (16 + 4) x h, kv up (4 x 18) x 16, proj h x 40
    mla = 24 * h + 48 * 24 + 20 * h + 72 * 16 + h * 40 + 24 + 16  # + the latent norms
    layer = mla + 2 * h + experts * h + (experts + 1) * 3 * h * f  # norms, router, experts
    assert frozen["parameters"] == lora["parameters"] - lora["trainable_parameters"] == \
        layers * layer + 2 * v * h + h
    assert frozen["trainable_parameters"] == h  # the final norm
    qkv = (h + 24) + (24 + 48) + (h + 20) + (16 + 72)  # q down, q up, kv down, kv up
    assert lora["trainable_parameters"] == layers * r * (
        qkv + (40 + h) + (experts + 1) * ((h + 2 * f) + (f + h)))
    for name in ("frozen", "floor", "lora"):
        assert result["modes"][name]["flops_per_token"] == flops_per_token(
            _run_shape(result), 64, name)


def test_deepseek_v3_shape_is_its_config():
    """The check's DeepSeek-V3 sizes are what the family reads from its config.json."""
    import dataclasses

    from benchmarks.gpu.check import SHAPE_DEEPSEEK_V3
    from megatron_lora.families import model_info

    config = json.load(open(os.path.join(REPO, "examples", "deepseek_v3", "config.json")))
    shape = model_info(config).shape
    for key, value in SHAPE_DEEPSEEK_V3.items():
        if key in ("yarn", "mla"):
            assert {k: v for k, v in dataclasses.asdict(getattr(shape, key)).items()
                    if k in value} == value, key
        elif key not in ("num_layers", "max_position_embeddings"):
            assert getattr(shape, key) == value, key
    assert shape.moe_layer_pattern[-2:] == (1, 1)  # the check's 2 layers are MoE layers
    import torch

    from megatron_lora.models.gpt import ModelShape, transformer_config

    config = transformer_config(ModelShape(**SHAPE_DEEPSEEK_V3), ParallelLayout(),
                                dtype=torch.bfloat16, use_cpu_initialization=False)
    assert (type(config).__name__, config.q_lora_rank, config.num_moe_experts,
            config.moe_router_topk, config.moe_router_group_topk, config.rope_type) == \
        ("MLATransformerConfig", 1536, 256, 8, 4, "yarn")


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "deepseek-v3"])
def test_gpu_check_qlora_at_the_other_shapes(shape):
    """qlora at the Qwen3-30B-A3B and DeepSeek-V3 shapes (tiny sizes whose linear inputs are
    multiples of NF4's 64-wide blocks; MLA's latents and heads included): the LoRA of `lora` on
    an NF4 base, its fields agreeing with `lora`'s."""
    out = subprocess.run([sys.executable, "benchmarks/gpu/check.py", "--tiny", "--steps", "1",
                          "--warmup", "0", "--shape", shape, "--base-quantization", "nf4",
                          "--modes", "lora", "qlora", "--no-peer"],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    lora, qlora = result["modes"]["lora"], result["modes"]["qlora"]
    assert qlora["trainable_parameters"] == lora["trainable_parameters"]
    assert qlora["flops_per_token"] == lora["flops_per_token"]
    assert 0.5 < qlora["nf4_bytes_per_parameter"] < 0.53 and qlora["nf4_linears"] > 0
    assert result["qlora_over_lora"] > 0


_CHECKED = {}


@pytest.fixture(scope="module")
def checked_run(tmp_path_factory):
    """checked_run(shape): the JSON line of `check.py --tiny --shape SHAPE` (every mode, and the
    transformers + PEFT peer) run once per shape under testing/device_check.py, which must have
    seen no host tensor meet a device one and no collective get a host tensor (the first GPU
    run of this check crashed in every mode on those)."""

    def run(shape):
        if shape not in _CHECKED:
            report = str(tmp_path_factory.mktemp("checked") / "report.json")
            out = subprocess.run(
                [sys.executable, "-m", "megatron_lora.cli.device_check", report, "--",
                 "benchmarks/gpu/check.py", "--tiny", "--steps", "1", "--warmup", "0",
                 "--shape", shape],
                cwd=REPO, capture_output=True, text=True, timeout=600,
                env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                         PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])))
            with open(report) as f:
                seen = json.load(f)
            assert seen["errors"] == [] and seen["exit_codes"] == [0], (
                seen["errors"], out.stdout[-3000:], out.stderr[-3000:])
            _CHECKED[shape] = json.loads(out.stdout.strip().splitlines()[-1])
        return _CHECKED[shape]

    return run


@pytest.mark.parametrize("shape", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"])
def test_gpu_check_runs_every_mode_as_on_a_gpu(checked_run, shape):
    """Every mode of each shape and the peer, as on a GPU (checked_run), from one run."""
    result = checked_run(shape)
    from benchmarks.gpu.check import shape_modes

    assert set(result["modes"]) == {m if g else f"{m}_sequential" for m, g in shape_modes(shape)}
    if shape == "deepseek-v3":
        assert result["peer"] is None and result["lora_over_peft_lora"] is None
    else:  # the peer timed its four modes, ratios from the same run
        assert set(result["peer"]) == {"frozen", "floor", "lora", "full"}
        ours, peer = result["modes"], result["peer"]
        for a, b in (("lora", "lora"), ("frozen", "frozen"), ("floor", "floor"),
                     ("full", "full")):
            x, y = ours[a]["ms_per_step"], peer[b]["ms_per_step"]  # both printed to 0.01 ms
            assert result[f"{a}_over_peft_{b}"] == pytest.approx(
                x / y, abs=_ratio_bound(x, y)), a
        x, y = peer["lora"]["ms_per_step"], peer["floor"]["ms_per_step"]
        assert result["peft_lora_over_peft_floor"] == pytest.approx(x / y, abs=_ratio_bound(x, y))
        assert peer["floor"]["trainable_parameters"] == peer["frozen"]["trainable_parameters"]
        # PEFT's adapters are ours (r=16 on every expert's gate_up / down and on attention),
        # except that q, k and v have an A each where our linear_qkv has one: 2 r h more a layer.
        size = result["shape"]
        assert result["peer"]["lora"]["trainable_parameters"] == \
            result["modes"]["lora"]["trainable_parameters"] + \
            2 * 16 * size["hidden_size"] * size["num_layers"]


def test_gpu_check_time_budget_skips_and_still_reports():
    """--time-budget: a mode that would end after the budget is skipped (0 s: every one), named
    in `skipped`, and the JSON line still comes (a device call's time limit sees it)."""
    out = subprocess.run([sys.executable, "benchmarks/gpu/check.py", "--tiny", "--steps", "1",
                          "--modes", "frozen", "floor", "--time-budget", "0", "--no-peer"],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["modes"] == {} and result["skipped"] == ["frozen", "floor"]
    assert result["lora_over_floor"] is None
