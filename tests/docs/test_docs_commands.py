"""Every `megatron-lora` command shown in docs/ (```bash blocks: `megatron-lora ...`,
`python -m megatron_lora ...`, `torchrun --nproc-per-node N -m megatron_lora ...`) is parsed by
the real command-line parser as written, and its parallel layout fits its torchrun world for
Mixtral 8x7B (the model the docs are about) with the checks the commands run before starting, so
a renamed flag, a bad choice or a layout that the command would refuse cannot sit in the docs.

The same commands are run as written on the tiny model by tests/docs/test_docs_run.py; this test
adds that their layouts would also be accepted for the 8x7B model (docs/training.md's API
program: tests/training/test_api_docs.py)."""

import glob
import json
import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIXTRAL_8X7B = dict(  # config.json of mistralai/Mixtral-8x7B-v0.1
    architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000,
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False,
    hidden_act="silu", sliding_window=None, torch_dtype="bfloat16")


def _commands():
    """(where, world size, argv after the program name) of every megatron-lora command."""
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        text = open(path, encoding="utf-8").read()
        for block in re.finditer(r"```bash\n(.*?)```", text, re.S):
            start = text.count("\n", 0, block.start()) + 2
            joined = re.sub(r"\\\n\s*", " ", block.group(1))
            for line in joined.splitlines():
                line = line.split(" #", 1)[0].strip()
                if not re.match(r"(megatron-lora|torchrun|\S*python\S* -m megatron_lora)\b",
                                line):
                    continue  # other programs, comments, and text inside a python -c '...'
                words = shlex.split(line)
                where = f"{os.path.relpath(path, ROOT)} block at line {start}: {line[:60]}"
                if words[:1] == ["megatron-lora"]:
                    found.append((where, 1, words[1:]))
                elif "-m" in words and words[words.index("-m") + 1:][:1] == ["megatron_lora"]:
                    world = 1
                    if words[0] == "torchrun":
                        world = int(words[words.index("--nproc-per-node") + 1])
                    found.append((where, world, words[words.index("-m") + 2:]))
    return found


COMMANDS = _commands()


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 10, COMMANDS  # the extraction itself works


@pytest.mark.parametrize("where,world,argv", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_docs_command_parses_and_its_layout_fits(where, world, argv, tmp_path, capsys):
    from megatron_lora.cli import build_parser
    from megatron_lora.families import read_hf_config

    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: the parser refused it: {capsys.readouterr().err.strip()}")
    if hasattr(args, "tensor_model_parallel_size"):
        from megatron_lora.cli.common import layout_from_args

        config = tmp_path / "config.json"
        config.write_text(json.dumps(MIXTRAL_8X7B))
        info = read_hf_config(str(config))
        info.validate_layout(layout_from_args(args), world, flags=True)
