"""training.run_folder: which existing --save folders a run may write into."""

import pytest

from megatron_lora.training.run_folder import foreign_entries, save_problem


@pytest.mark.parametrize("entries,foreign", [
    ([], []),
    (["latest_checkpointed_iteration.txt", "iter_0000005", "metrics.jsonl", "notes.txt"], []),
    (["iter_0000002/"], []),  # a complete iteration folder: a run's
    (["metrics.jsonl", "loss_curve.png"], []),  # stopped before its first checkpoint
    (["tokenizer/", "wandb/", "iter_0000003.tmp/"], []),  # stopped before its first log line
    (["config.json", "model.safetensors", "tokenizer/"], ["config.json", "model.safetensors"]),
    (["iter_0000003.tmp/", "data.jsonl"], ["data.jsonl"]),
    (["tb/"], ["tb"]),
])
def test_foreign_entries(tmp_path, entries, foreign):
    for name in entries:
        if name.endswith("/"):
            (tmp_path / name).mkdir()
        else:
            (tmp_path / name).write_text("x")
    assert foreign_entries(str(tmp_path)) == foreign
    assert foreign_entries(str(tmp_path / "missing")) == []


def test_names_of_other_outputs_inside_save_and_the_message(tmp_path):
    for i in range(6):
        (tmp_path / f"shard{i}.safetensors").write_text("x")
    (tmp_path / "tb").mkdir()
    assert "tb" not in foreign_entries(str(tmp_path), also=["tb"])
    message = save_problem(str(tmp_path), also=["tb"])
    assert message == (f"--save {tmp_path} already holds files that are not a training run "
                       f"(shard0.safetensors, shard1.safetensors, shard2.safetensors, "
                       f"shard3.safetensors and 2 more); a run writes its checkpoints and logs "
                       f"into --save: give a new or empty folder, or the folder of an earlier run "
                       f"to resume it")
