"""`train --config run.yaml`, `--help`, `--lora-alpha-pattern`, and train's setup checks of
`--adapter` / `--valid-data-path`: all in this process, before any collective (nothing here makes
a process group)."""

import argparse
import os

import pytest
import torch.distributed as dist

from megatron_lora.cli import build_parser
from megatron_lora.cli import train as train_cli

REQUIRED = ["--load-hf", "hf", "--data-path", "d.jsonl", "--tokenizer", "byte", "--seq-length",
            "32", "--global-batch-size", "4", "--train-iters", "3"]


def _parse(*argv):
    return vars(build_parser().parse_args(["train", *argv]))


def _refused(capsys, *argv):
    """stderr of a parse that must exit 2."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["train", *argv])
    assert exc.value.code == 2
    assert not dist.is_initialized()
    return capsys.readouterr().err


def _yaml(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_config_file_gives_flags_in_both_spellings(tmp_path):
    path = _yaml(tmp_path, """
load_hf: hf
data-path: d.jsonl
tokenizer: byte
seq_length: 32
global-batch-size: 4
train_iters: 3
lora-target-modules: [linear_qkv, router]
lora_rank_pattern: [router=2]
lora-alpha-pattern: ["experts=4.5"]
bf16: true
lora-use-rslora: false
moe-grouped-gemm: false
override-opt_param-scheduler: true
lr: 1
expert-tensor-parallel-size: null
""")
    got = _parse("--config", path)
    want = _parse(*REQUIRED, "--lora-target-modules", "linear_qkv", "router",
                  "--lora-rank-pattern", "router=2", "--lora-alpha-pattern", "experts=4.5",
                  "--bf16", "--no-moe-grouped-gemm", "--override-opt_param-scheduler",
                  "--lr", "1")
    for d in (got, want):
        d.pop("config"), d.pop("func")
        given = d.pop("given_flags")
    assert got == want
    assert got["lora_alpha_pattern"] == [("experts", 4.5)] and isinstance(got["lr"], float)
    assert {"lora_target_modules", "lr", "bf16"} <= given


def test_command_line_overrides_the_file_wherever_it_stands(tmp_path):
    path = _yaml(tmp_path, "load-hf: hf\nlora-rank: 8\nlora-target-modules: [router]\n"
                           "use-checkpoint-opt_param-scheduler: true\n")
    rest = [a for a in REQUIRED if a not in ("--load-hf", "hf")]
    before = _parse("--lora-rank", "2", "--load", "m", "--override-opt_param-scheduler",
                    "--config", path, *rest)
    after = _parse("--config", path, *rest, "--lora-rank", "2", "--load", "m",
                   "--override-opt_param-scheduler")
    for got in (before, after):
        assert got["lora_rank"] == 2 and got["lora_target_modules"] == ["router"]
        # a command-line member of a mutually exclusive pair replaces the file's other member
        assert got["load"] == "m" and got["load_hf"] is None
        assert got["override_opt_param_scheduler"] and not got["use_checkpoint_opt_param_scheduler"]


@pytest.mark.parametrize("text,message", [
    ("lora-rnk: 8\n", "key 'lora-rnk': not a flag of this command (did you mean 'lora-rank'?)"),
    ("lora-rank: eight\n", "key 'lora-rank': expected an integer, got 'eight'"),
    ("lora-rank: 8.5\n", "key 'lora-rank': expected an integer, got 8.5"),
    ("lr: fast\n", "key 'lr': expected a number, got 'fast'"),
    ("bf16: 1\n", "key 'bf16': expected true or false, got 1"),
    ("lora-target-modules: linear_qkv\n", "key 'lora-target-modules': expected a list"),
    ("lora-rank-pattern: [router=x]\n", "key 'lora-rank-pattern[0]': 'router=x': expected "
                                        "REGEX=R"),
    ("lr-decay-style: steep\n", "key 'lr-decay-style': 'steep' is not one of constant"),
    ("tokenizer: 12\n", "key 'tokenizer': expected a string, got 12"),
    ("seq-length: null\n", "key 'seq-length': null is not a value of --seq-length"),
    ("lora-rank: 8\nlora_rank: 4\n", "key 'lora_rank': the same flag as key 'lora-rank'"),
    ("config: other.yaml\n", "key 'config': a configuration file cannot name another one"),
    ("- lora-rank\n", "expected a mapping of flag names to values"),
    ("lora-rank: [8\n", "not valid YAML (line 2, column 1)"),
])
def test_bad_config_file_is_an_exit_2_error_naming_file_and_key(tmp_path, capsys, text, message):
    path = _yaml(tmp_path, text)
    err = _refused(capsys, "--config", path, *REQUIRED)
    assert f"{path}: {message}" in err or f"--config {path}: {message}" in err, err
    assert "Traceback" not in err


def test_missing_config_file_and_missing_required_flags(tmp_path, capsys):
    missing = str(tmp_path / "nope.yaml")
    err = _refused(capsys, "--config", missing, *REQUIRED)
    assert f"--config {missing}: cannot read the file: No such file or directory" in err
    # a file without the model flag: argparse's own message, naming the file
    path = _yaml(tmp_path, "tokenizer: byte\n")
    rest = [a for a in REQUIRED if a not in ("--load-hf", "hf")]
    err = _refused(capsys, "--config", path, *rest)
    assert "one of the arguments --load-hf --load is required" in err
    path = _yaml(tmp_path, "load-hf: null\nload: null\n", "nulls.yaml")
    err = _refused(capsys, "--config", path, *rest)
    assert f"one of the arguments --load-hf --load is required (on the command line or in " \
           f"--config {path})" in err
    # no abbreviations (Megatron-LM's parser takes none either)
    assert "unrecognized arguments: --lora-ra 8" in _refused(capsys, *REQUIRED, "--lora-ra", "8")


def test_resolved_config_round_trips(tmp_path):
    import yaml

    from megatron_lora.cli.run_config import dump, resolved

    args = build_parser().parse_args(["train", *REQUIRED, "--lora-rank-pattern", "router=2",
                                      "--lora-alpha-pattern", "router=0.1", "--bf16",
                                      "--recompute-modules", "core_attn", "moe"])
    config = resolved(train_cli.parser(), args)
    assert "config" not in config and "help" not in config
    path = _yaml(tmp_path, dump(config))
    assert yaml.safe_load(open(path)) == config
    again = build_parser().parse_args(["train", "--config", path])
    skip = ("config", "func", "given_flags")
    assert {k: v for k, v in vars(again).items() if k not in skip} == {
        k: v for k, v in vars(args).items() if k not in skip}


def test_help_shows_every_flag_with_help_and_default(capsys):
    p = train_cli.parser()
    assert p.formatter_class is argparse.ArgumentDefaultsHelpFormatter
    missing = [a.option_strings[0] for a in p._actions if a.option_strings and not a.help]
    assert missing == []
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    out = capsys.readouterr().out
    assert "(default: 0.0001)" in out and "(default: cosine)" in out
    assert "--lora-alpha-pattern REGEX=A" in out and "--valid-data-path FILE" in out


# ---- train's setup checks (cli/train_run.py), in this process: no collective before them ----

@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_example):
    return tiny_example(tmp_path_factory.mktemp("tiny_rc"), samples=24)


def _setup(tiny, *extra, **kw):
    from megatron_lora.runtime import ParallelLayout
    from megatron_lora.cli.train_run import _setup_checks

    args = build_parser().parse_args(
        ["train", "--load-hf", os.path.join(tiny, "hf"), "--data-path",
         os.path.join(tiny, "data.jsonl"), "--tokenizer", "byte", "--seq-length", "32",
         "--global-batch-size", "4", "--train-iters", "2", *extra])
    out = _setup_checks(args, ParallelLayout(), 1)
    assert not dist.is_initialized()
    return args, out


def _setup_error(tiny, *extra):
    from megatron_lora.cli.train_run import TrainSetupError

    with pytest.raises(TrainSetupError) as exc:
        _setup(tiny, *extra)
    return str(exc.value)


def test_alpha_pattern_reaches_the_lora_config(tiny):
    _, (_, _, lora, *_) = _setup(tiny, "--lora-target-modules", "linear_proj", "router",
                                 "--lora-rank", "4", "--lora-alpha-pattern", "router=2.5")
    assert lora.alpha_pattern == {"router": 2.5}
    assert lora.adapter_config("decoder.layers.0.mlp.router").alpha == 2.5
    assert lora.adapter_config("decoder.layers.0.self_attention.linear_proj").alpha == 32.0
    assert "--lora-alpha-pattern" in _setup_error(tiny, "--lora-alpha-pattern", "nothing=2")


def test_validation_data_flags(tiny, tmp_path):
    err = _setup_error(tiny, "--valid-data-path", os.path.join(tiny, "data.jsonl"),
                       "--eval-fraction", "0.25")
    assert "--valid-data-path and --eval-fraction both give validation data" in err
    err = _setup_error(tiny, "--eval-interval", "1")
    assert "--eval-interval needs validation data: give --valid-data-path FILE, or hold out " \
           "part of --data-path with --eval-fraction F" in err
    bad = tmp_path / "valid.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": \n')
    assert f"--valid-data-path: {bad}:2" in _setup_error(tiny, "--valid-data-path", str(bad))
    (tmp_path / "empty.jsonl").write_text("\n")
    err = _setup_error(tiny, "--valid-data-path", str(tmp_path / "empty.jsonl"))
    assert f"--valid-data-path: {tmp_path / 'empty.jsonl'}: no usable samples" in err
    _, (*_, (train, evaluation, stats), _) = _setup(
        tiny, "--valid-data-path", os.path.join(tiny, "data.jsonl"), "--eval-interval", "1")
    assert stats["held_out"] == len(evaluation) and len(train) == stats["sequences"]


def _adapter_checkpoint(tiny, out, **lora):
    """An adapter checkpoint of ours (import peft's format) with LoRA config `lora`."""
    import torch

    from megatron_lora.export.adapter_ckpt import write_adapter_checkpoint
    from megatron_lora.export.table import KINDS, factor_shapes
    from megatron_lora.lora.model import LoraConfig
    from megatron_lora.families import read_hf_config

    info = read_hf_config(os.path.join(tiny, "hf"))
    config = LoraConfig(**lora)
    ranks = {k: config.r for k in config.target_modules}
    kinds = {k.name: k for k in KINDS}

    def factors(site):
        a, b = factor_shapes(info, kinds[site.kind.name], config.r)
        return torch.ones(a[-2:]), torch.ones(b[-2:])

    write_adapter_checkpoint(str(out), info, ranks, factors, config, torch.float32)
    return str(out)


def test_adapter_brings_its_lora_config(tiny, tmp_path):
    path = _adapter_checkpoint(tiny, tmp_path / "ad", r=2, lora_alpha=3.0,
                               target_modules=["linear_proj"], use_rslora=True)
    args, (_, _, lora, *_, initial) = _setup(tiny, "--adapter", path, "--lora-dropout", "0.1",
                                             "--seed", "9")
    assert (lora.r, lora.lora_alpha, lora.target_modules, lora.use_rslora) == (
        2, 3.0, ("linear_proj",), True)
    assert (lora.lora_dropout, lora.seed) == (0.1, 9)  # this run's
    assert initial.directory == path and args.lora_rank == 2  # recorded in the run config
    err = _setup_error(tiny, "--adapter", path, "--lora-rank", "16", "--lora-target-modules",
                       "linear_proj", "--lora-alpha", "3")
    assert (f"--adapter {path} has its own LoRA configuration, and these flags differ from it: "
            f"--lora-rank 16 (the adapter's: 2). Its rank") in err  # equal flags are fine
    err = _setup_error(tiny, "--adapter", str(tmp_path / "nothing"))
    assert "--adapter " + str(tmp_path / "nothing") + ": no such folder; expected an adapter" in err


def test_adapter_with_a_checkpoint_in_save_resumes_it(tiny, tmp_path):
    """Megatron-LM resumes from its checkpoint; --finetune applies only when a run starts."""
    import shutil

    save = tmp_path / "run"
    _adapter_checkpoint(tiny, tmp_path / "ad", r=2, target_modules=["linear_proj"])
    save.mkdir()
    shutil.copytree(tmp_path / "ad", save / "iter_0000005")
    (save / "latest_checkpointed_iteration.txt").write_text("5\n")
    args, (_, _, lora, *_, initial) = _setup(tiny, "--adapter", str(tmp_path / "gone"),
                                             "--save", str(save))
    assert initial.directory is None and lora.r == 2  # the adapter is not read at all
    assert "has a checkpoint (iteration 5): resuming it; --adapter" in initial.notes[0]
    err = _setup_error(tiny, "--adapter", str(tmp_path / "gone"), "--save", str(save),
                       "--lora-rank", "4")
    assert "--lora-rank 4 (the checkpoint's: 2)" in err
