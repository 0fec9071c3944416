"""The launch scripts in examples/mixtral_8x7b, examples/qwen3_moe, examples/glm4_moe,
examples/gpt_oss and examples/deepseek_v3 use only flags `megatron-lora train` accepts, with the
fast path (sequence 4096, memory-efficient attention; grouped experts are the default), so the
scripts cannot rot silently; the GPT-OSS and DeepSeek-V3 scripts' layouts fit their published
configs at their torchrun world (biased experts at expert-TP 1; DeepSeek-V3's multi-latent
attention split over TP8, its LoRA targets and NF4 blocks accepted). The scripts need GPUs to
run; here their `megatron_lora train ...` arguments go through the real parser."""

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = [os.path.join("mixtral_8x7b", s) for s in ("train_1node.sh", "train_multinode.sh",
                                                     "train.slurm")] + \
    [os.path.join("qwen3_moe", s) for s in ("train_1node.sh", "train_multinode.sh")] + \
    [os.path.join("glm4_moe", "train_1node.sh")] + \
    [os.path.join("gpt_oss", s) for s in ("train_20b_1gpu.sh", "train_120b_1node.sh")]
DEEPSEEK_SCRIPTS = [os.path.join("deepseek_v3", s) for s in ("train_nodes.sh",
                                                             "train_1node_nf4.sh")]


# Stand-ins for the launchers: torchrun writes the arguments it was given after
# `megatron_lora train`, one per line, to $ARGS_OUT; srun runs its command; scontrol names a host.
LAUNCHERS = {
    "torchrun": '#!/usr/bin/env bash\nwhile [ "$1" != train ]; do shift; done; shift\n'
                'printf "%s\\n" "$@" > "$ARGS_OUT"\n',
    "srun": '#!/usr/bin/env bash\nexec "$@"\n',
    "scontrol": '#!/usr/bin/env bash\necho node0\n',
}
ENV = {name: f"/placeholder/{name}" for name in
       ("HF", "DATA", "SAVE", "MCORE", "MASTER", "MASTER_ADDR", "SLURM_JOB_NODELIST")}
ENV.update(NNODES="2", NODE_RANK="0", SLURM_NNODES="2", SLURM_JOB_ID="1")


def _train_args(path, *extra, tmp=None):
    """The arguments the script passes to `megatron_lora train` when run with `extra` (its own
    arguments), through stand-in launchers (no GPU, nothing launched)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        for name, text in LAUNCHERS.items():
            with open(os.path.join(folder, name), "w") as f:
                f.write(text)
            os.chmod(os.path.join(folder, name), 0o755)
        out = os.path.join(folder, "args")
        env = dict(os.environ, **ENV, ARGS_OUT=out,
                   PATH=folder + os.pathsep + os.environ["PATH"])
        done = subprocess.run(["bash", path, *extra], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        return open(out).read().splitlines()


@pytest.mark.parametrize("script", SCRIPTS + DEEPSEEK_SCRIPTS)
def test_example_script_flags_parse(script):
    from megatron_lora.cli import build_parser

    args = build_parser().parse_args(
        ["train"] + _train_args(os.path.join(REPO, "examples", script)))
    assert args.seq_length == 4096
    assert args.attention_backend == "flash"
    assert args.moe_grouped_gemm in (None, True)  # None: grouped experts with the local layers
    assert args.bf16 and (args.sequence_parallel or args.tensor_model_parallel_size == 1)
    assert set(args.lora_target_modules) == {"linear_qkv", "linear_proj", "linear_fc1",
                                             "linear_fc2"}


@pytest.mark.parametrize("script,config", [("train_20b_1gpu.sh", "config_20b.json"),
                                           ("train_120b_1node.sh", "config_120b.json")])
def test_gpt_oss_scripts_fit_their_models(script, config):
    import json

    from megatron_lora.cli import build_parser
    from megatron_lora.cli.common import layout_from_args
    from megatron_lora.families import model_info

    path = os.path.join(REPO, "examples", "gpt_oss", script)
    args = build_parser().parse_args(["train"] + _train_args(path))
    world = int(re.search(r"--nproc-per-node (\d+)", open(path).read()).group(1))
    info = model_info(json.load(open(os.path.join(REPO, "examples", "gpt_oss", config))))
    assert info.shape.yarn is not None and info.shape.yarn.factor == 32.0
    assert info.layout_problems(layout_from_args(args), world, flags=True) == []


@pytest.mark.parametrize("script,world", [("train_nodes.sh", 16), ("train_1node_nf4.sh", 8)])
def test_deepseek_v3_scripts_fit_the_model(script, world):
    """At the script's world (2 nodes of 8 by default; one node), the published DeepSeek-V3
    config accepts the layout (TP8 divides q_lora_rank 1536, kv_lora_rank + rope 576 and the 128
    heads; EP over 256 experts), the LoRA targets and, for --base-quantization nf4, the NF4 block
    widths per rank."""
    import json

    from megatron_lora.cli import build_parser
    from megatron_lora.cli.common import layout_from_args
    from megatron_lora.families import model_info
    from megatron_lora.lora.model import LoraConfig
    from megatron_lora.lora.sizes import model_problems
    from megatron_lora.models.nf4_model import nf4_layout_problems

    path = os.path.join(REPO, "examples", "deepseek_v3", script)
    text = open(path).read()
    assert world == 8 * int(re.search(r"--nnodes \"\$\{NNODES:-(\d+)\}\"", text).group(1)
                            if "--nnodes" in text else 1)
    args = build_parser().parse_args(["train"] + _train_args(path))
    info = model_info(json.load(open(os.path.join(REPO, "examples", "deepseek_v3",
                                                  "config.json"))))
    assert info.shape.mla is not None and info.shape.num_experts == 256
    layout = layout_from_args(args)
    assert info.layout_problems(layout, world, flags=True) == []
    lora = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha,
                      target_modules=args.lora_target_modules)
    assert model_problems(lora, info) == []
    assert (args.base_quantization == "nf4") == (script == "train_1node_nf4.sh")
    assert nf4_layout_problems(info.shape, layout) == []
    if script == "train_nodes.sh":
        assert args.recompute_granularity == "full" and args.load and not args.load_hf


@pytest.mark.parametrize("script", SCRIPTS + [os.path.join("deepseek_v3", "train_1node_nf4.sh")])
def test_load_among_the_arguments_replaces_load_hf(script):
    """The scripts' advice (`--load MCORE_DIR` to start faster) works: the script leaves out its
    --load-hf, which argparse refuses beside --load."""
    from megatron_lora.cli import build_parser

    path = os.path.join(REPO, "examples", script)
    assert "pass --load instead" not in open(path).read()
    for extra in (["--load", "/converted"], ["--load=/converted"]):
        argv = _train_args(path, *extra)
        assert "--load-hf" not in argv, argv
        args = build_parser().parse_args(["train"] + argv)
        assert (args.load, args.load_hf) == ("/converted", None)
    args = build_parser().parse_args(["train"] + _train_args(path))
    assert (args.load, args.load_hf) == (None, "/placeholder/HF")
