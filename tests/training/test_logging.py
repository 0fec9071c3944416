"""training/logging.py in one process: the metrics history across a resume and the plot drawn
from it, the TensorBoard tags as written to the event file, W&B in offline mode, and the W&B
checks made before training."""

import glob
import json
import os
import struct
import sys
import time

import pytest

from megatron_lora.training.logging import (GRAD_NORM, LOSS, LR, MFU, TFLOPS, TOKENS_PER_S,
                                            VALID_LOSS, TrainingLog, WandbSettings, read_metrics,
                                            run_series, wandb_problems)
from megatron_lora.training.loop import RunConfig


def _train(log, iterations, loss_of, valid=()):
    for it in iterations:
        log.iteration(it, loss=loss_of(it), lr=1e-3 / it, grad_norm=0.5 + it, tokens=10,
                      consumed_samples=4 * it, global_batch_size=4, log=True)
        if it in valid:
            log.validation(it, 3.0 - it / 10)


def test_history_survives_a_crash_and_a_resume_and_the_plot_covers_the_whole_run(tmp_path):
    metrics = str(tmp_path / "run" / "metrics.jsonl")
    first = TrainingLog(True, 6, None, metrics_path=metrics)
    _train(first, range(1, 5), lambda it: 10.0 + it, valid=(2, 4))
    with open(metrics, "a") as f:  # killed while writing iteration 5's line
        f.write('{"iteration": 5, "lm lo')
    # (no close: the job was killed.) The checkpoint is at iteration 3: 4.. are trained again.
    second = TrainingLog(True, 6, None, start_iteration=3, metrics_path=metrics)
    _train(second, range(4, 7), lambda it: 20.0 + it, valid=(6,))
    plot = str(tmp_path / "run" / "loss_curve.png")
    assert second.close(plot) == plot
    with open(plot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    series = run_series(read_metrics(metrics))
    assert series[LOSS] == {1: 11.0, 2: 12.0, 3: 13.0, 4: 24.0, 5: 25.0, 6: 26.0}
    assert series[VALID_LOSS] == {2: 2.8, 6: 2.4}  # iteration 4's came from the lost part
    assert sorted(series[LR]) == sorted(series[GRAD_NORM]) == [1, 2, 3, 4, 5, 6]
    with open(metrics) as f:  # the torn line is gone, every line is whole
        lines = f.read().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [1, 2, 2, 3, 4, 5, 6, 6]


def test_a_fresh_run_starts_a_new_history(tmp_path):
    metrics = str(tmp_path / "metrics.jsonl")
    _train(TrainingLog(True, 3, None, metrics_path=metrics), range(1, 4), float)
    _train(TrainingLog(True, 2, None, metrics_path=metrics), range(1, 3), lambda it: 7.0)
    assert run_series(read_metrics(metrics))[LOSS] == {1: 7.0, 2: 7.0}


def _tfrecords(path):
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        (n,) = struct.unpack("<Q", data[pos:pos + 8])
        yield data[pos + 12:pos + 12 + n]
        pos += 12 + n + 4


def test_tensorboard_tags_are_megatron_lm_names(tmp_path):
    from tensorboardX.proto.event_pb2 import Event

    log = TrainingLog(True, 2, str(tmp_path / "tb"))
    _train(log, (1, 2), lambda it: 5.0 + it, valid=(2,))
    log.close(None)
    scalars = {}
    for path in glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*")):
        for raw in _tfrecords(path):
            event = Event.FromString(raw)
            for v in event.summary.value:
                scalars[(v.tag, event.step)] = v.simple_value
    assert scalars.pop((TOKENS_PER_S, 1)) > 0 and scalars.pop((TOKENS_PER_S, 2)) > 0
    # tensorboard's simple_value is fp32: each value is the logged float rounded once to fp32
    fp32 = lambda x: struct.unpack("<f", struct.pack("<f", x))[0]  # noqa: E731
    assert scalars == {("lm loss", 1): 6.0, ("learning-rate", 1): fp32(1e-3),
                       ("grad-norm", 1): 1.5, ("lm loss", 2): 7.0,
                       ("learning-rate", 2): fp32(1e-3 / 2), ("grad-norm", 2): 2.5,
                       ("lm loss validation", 2): fp32(3.0 - 2 / 10)}


def _wandb_history(run_file):
    """{(key, step): value} of the history records of a .wandb file (leveldb-log framing: 32 KiB
    blocks of records with a 7-byte header crc32c(4) length(2) type(1) after a 7-byte file
    header; types 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto.wandb_internal_pb2 import Record

    with open(run_file, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:8]
    pos, pending, out = 7, b"", {}
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = Record.FromString(pending)
            if record.WhichOneof("record_type") == "history":
                items = {i.key or ".".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item}
                step = items.get("_step", record.history.step.num)
                out.update({(k, step): v for k, v in items.items() if not k.startswith("_")})
    return out


def test_wandb_offline_run_holds_the_logged_scalars(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_env"))
    save_dir = str(tmp_path / "save" / "wandb")
    log = TrainingLog(True, 3, None, wandb=WandbSettings("mlora-test", "tiny", save_dir,
                                                         {"lr": 1e-3}))
    _train(log, (1, 2, 3), lambda it: 4.0 - it / 8, valid=(3,))
    log.close(None)
    files = glob.glob(os.path.join(save_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(files) == 1, os.listdir(save_dir)
    # wandb's service process writes the file; under a loaded suite its last records were once
    # seen to land after finish() returned, so the file is read until they are there (<= 60 s)
    deadline = time.monotonic() + 60
    while True:
        history = _wandb_history(files[0])
        if (VALID_LOSS, 3) in history or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {k: v for k, v in history.items() if k[0] in (LOSS, VALID_LOSS)} == {
        (LOSS, 1): 3.875, (LOSS, 2): 3.75, (LOSS, 3): 3.625, (VALID_LOSS, 3): 3.0 - 3 / 10}
    # wandb keeps the logged Python floats (JSON, exact): the values _train computed
    assert history[(LR, 2)] == 1e-3 / 2 and history[(GRAD_NORM, 3)] == 3.5


def test_wandb_default_folder_is_in_save():
    run = RunConfig(micro_batch_size=1, global_batch_size=1, seq_length=8, train_iters=1,
                    save="/runs/a", wandb_project="p")
    assert run.wandb_settings().dir == "/runs/a/wandb"
    assert RunConfig(micro_batch_size=1, global_batch_size=1, seq_length=8, train_iters=1,
                     save="/runs/a", wandb_project="p",
                     wandb_save_dir="/w").wandb_settings().dir == "/w"
    assert RunConfig(micro_batch_size=1, global_batch_size=1, seq_length=8,
                     train_iters=1).wandb_settings() is None


def test_wandb_missing_is_refused_when_the_run_is_configured(monkeypatch):
    assert wandb_problems("p") == []
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    assert wandb_problems(None) == []
    (problem,) = wandb_problems("p")
    assert "--wandb-project needs the wandb package" in problem and "[wandb]" in problem
    with pytest.raises(ValueError, match="--wandb-project needs the wandb package"):
        RunConfig(micro_batch_size=1, global_batch_size=1, seq_length=8, train_iters=1,
                  wandb_project="p")
    assert wandb_problems(None, "name") == ["--wandb-exp-name needs --wandb-project"]


def test_logged_iterations_carry_tflops_and_mfu(tmp_path, capsys, monkeypatch):
    """Per logged line: tflops = step FLOPs x iterations since the last line / seconds / devices,
    mfu = tflops / the device's peak; the line shows both beside tokens/s."""
    clock = iter([100.0, 104.0, 110.0, 200.0, 201.0])  # start, the lines of 2 and 3; no_peak
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    metrics = str(tmp_path / "metrics.jsonl")
    log = TrainingLog(True, 3, None, metrics_path=metrics, step_flops=6e12, devices=2,
                      peak_tflops=0.5)
    for it in (1, 2, 3):
        log.iteration(it, loss=1.0, lr=1e-3, grad_norm=1.0, tokens=100, consumed_samples=it,
                      global_batch_size=1, log=it >= 2)
    records = read_metrics(metrics)
    assert TFLOPS not in records[0] and TOKENS_PER_S not in records[0]  # not a logged line
    # iterations 1-2 in 4 s: 2 x 6e12 / 4 / 2 devices; iteration 3 in 6 s: 6e12 / 6 / 2. Within
    # a few fp64 roundings (2**-53 each) of the exact quotients: rel 1e-15
    assert records[1][TFLOPS] == pytest.approx(1.5, rel=1e-15)
    assert records[1][MFU] == pytest.approx(3.0, rel=1e-15)
    assert records[1][TOKENS_PER_S] == pytest.approx(50.0, rel=1e-15)
    assert records[2][TFLOPS] == pytest.approx(0.5, rel=1e-15)
    assert records[2][MFU] == pytest.approx(1.0, rel=1e-15)
    lines = capsys.readouterr().out.splitlines()
    assert "tokens/s: 50 | TFLOP/s per device: 1.5 | MFU: 300.0% |" in lines[0]
    no_peak = TrainingLog(True, 1, None, step_flops=1e12)
    no_peak.iteration(1, loss=1.0, lr=1e-3, grad_norm=None, tokens=1, consumed_samples=1,
                      global_batch_size=1, log=True)
    assert TFLOPS in no_peak.history[0] and MFU not in no_peak.history[0]
    assert "MFU" not in capsys.readouterr().out
