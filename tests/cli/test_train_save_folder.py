"""`train --save` into a folder that holds something other than a run (an HF model folder) is
refused before any work, naming a few of the entries; nothing in the folder changes."""

import os

import pytest

from tests.cli.test_train_cli import _cmd, _in_process, single_rank_env  # noqa: F401


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_example):
    return tiny_example(tmp_path_factory.mktemp("save_folder"), samples=16)


def _listing(folder):
    return sorted((p, os.path.getsize(os.path.join(r, p))) for r, _, fs in os.walk(folder)
                  for p in fs)


def test_save_into_a_model_folder_is_refused(tiny, tmp_path, capsys, single_rank_env):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(os.path.join(tiny, "hf"), model)
    before = _listing(model)
    code, err = _in_process(_cmd(tiny, str(model), 2, ranks=1), capsys)
    assert code == 2, err[-2000:]
    assert "Traceback" not in err
    line = next(l for l in err.splitlines() if "not a training run" in l)
    assert line.startswith(f"megatron-lora train: error: --save {model} already holds files "
                           f"that are not a training run (config.json, "), line
    assert "give a new or empty folder, or the folder of an earlier run to resume it" in line
    assert _listing(model) == before  # nothing written among the model's files


def test_save_with_one_stray_file_is_refused_and_an_empty_folder_is_not(tiny, tmp_path, capsys,
                                                                       single_rank_env):
    save = tmp_path / "data"
    save.mkdir()
    (save / "notes.txt").write_text("mine")
    code, err = _in_process(_cmd(tiny, str(save), 2, "--lora-target-modules", "qproj",
                                 ranks=1), capsys)
    assert code == 2 and "(notes.txt)" in err, err[-2000:]
    (save / "notes.txt").unlink()  # empty now: the next problem (the bad target) is reported
    code, err = _in_process(_cmd(tiny, str(save), 2, "--lora-target-modules", "qproj",
                                 ranks=1), capsys)
    assert code == 2 and "unknown LoRA target 'qproj'" in err and "not a training run" not in err
