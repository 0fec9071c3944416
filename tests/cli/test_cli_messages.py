"""What the one-process commands say: --help with defaults and a help line for every flag,
`export` naming the iteration it exported and `export hf` merging without --merge, `convert
mcore-to-hf` given an adapter checkpoint pointing to `export hf`, and train's refusals of a rank
pattern that matches nothing and of --wandb-project without wandb (exit 2, before any
collective). Commands run through `main` in this process, as the other one-process CLI tests."""

import argparse
import os
import shutil
import sys

import pytest

from megatron_lora.cli import build_parser, main
from tests.cli.test_outputs import art  # noqa: F401  (the module's tiny model and adapter)

PORT = 29650 + os.getpid() % 200


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def _leaf_parsers():
    top = _subparsers(build_parser())
    for name in ("convert", "logits", "export", "import", "parity"):
        parser = top[name]
        children = _subparsers(parser)
        for child_name, child in children.items():
            yield f"{name} {child_name}", parser, child
        if not children:
            yield name, parser, parser


def test_help_shows_defaults_and_every_flag_has_help():
    seen = []
    for name, parent, parser in _leaf_parsers():
        seen.append(name)
        for p in (parent, parser):
            assert p.formatter_class is argparse.ArgumentDefaultsHelpFormatter, name
        missing = [a.dest for a in parser._actions
                   if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
                   and not (a.help or "").strip()]
        assert not missing, f"{name}: flags without help {missing}"
    assert seen == ["convert hf-to-mcore", "convert mcore-to-hf", "logits", "export peft",
                    "export hf", "import peft", "parity"]
    text = _subparsers(_subparsers(build_parser())["convert"])["mcore-to-hf"].format_help()
    assert "(default: 5GB)" in " ".join(text.split())
    text = " ".join(_subparsers(build_parser())["logits"].format_help().split())
    assert "--micro-batch-size MICRO_BATCH_SIZE" in text and "(default: 1)" in text


def test_export_hf_merges_without_merge_flag_and_exports_name_the_iteration(art, tmp_path,  # noqa: F811
                                                                          capsys):
    code = main(["export", "hf", "--load", art["mcore"], "--adapter", art["adapter"], "--save",
                 str(tmp_path / "merged"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"exported iteration 0 of {art['adapter']}" in err
    assert os.path.isfile(tmp_path / "merged" / "config.json")
    run = tmp_path / "run"  # a run folder whose newest checkpoint is iteration 7
    os.makedirs(run)
    shutil.copytree(art["adapter"], run / "iter_0000007")
    (run / "latest_checkpointed_iteration.txt").write_text("7")
    code = main(["export", "peft", "--adapter", str(run), "--load-hf", art["hf"], "--save",
                 str(tmp_path / "peft")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"exported iteration 0 of {run} ({run / 'iter_0000007'})" in err


def test_convert_mcore_to_hf_of_an_adapter_points_to_export_hf(art, tmp_path, capsys):  # noqa: F811
    run = tmp_path / "run"
    os.makedirs(run)
    shutil.copytree(art["adapter"], run / "iter_0000003")
    (run / "latest_checkpointed_iteration.txt").write_text("3")
    for adapter in (art["adapter"], str(run)):
        code = main(["convert", "mcore-to-hf", "--load", adapter, "--save",
                     str(tmp_path / "out"), "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2, err
        assert f"--load {adapter} is an adapter checkpoint" in err
        assert f"megatron-lora export hf --load BASE_MCORE --adapter {adapter} --save OUT" in err
        assert not os.path.exists(tmp_path / "out")


@pytest.fixture
def single_rank_env(monkeypatch):
    """The environment of a plain one-process run, restored after the test (`train` sets the
    torchrun variables it finds missing)."""
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                 ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", str(PORT))):
        monkeypatch.setenv(k, v)


def _train(art, tmp_path, *extra):
    return ["train", "--load-hf", art["hf"], "--data-path", art["data"], "--tokenizer", "byte",
            "--seq-length", "16", "--global-batch-size", "2", "--train-iters", "1",
            "--lora-rank", "2", "--lora-target-modules", "linear_qkv",
            "--save", str(tmp_path / "run"), *extra]


def test_train_refuses_a_rank_pattern_that_matches_nothing(art, tmp_path, capsys,  # noqa: F811
                                                           single_rank_env):
    code = main(_train(art, tmp_path, "--lora-rank-pattern", "experts=1"))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--lora-rank-pattern 'experts' matches no adapter of this model" in err, err
    assert "--lora-target-modules adapters" in err and "LoraConfig" not in err
    assert not os.path.exists(tmp_path / "run")


def test_train_refuses_wandb_project_without_wandb(art, tmp_path, capsys, single_rank_env,  # noqa: F811
                                                   monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails as if not installed
    code = main(_train(art, tmp_path, "--wandb-project", "mlora"))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--wandb-project needs the wandb package, which is not installed: pip install " \
           "'megatron-lora[wandb]'" in err, err
    assert not os.path.exists(tmp_path / "run")
