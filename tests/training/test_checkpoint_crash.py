"""Crash consistency of checkpoint saves, made deterministic: a crash is injected between each pair
of save steps (shards written / folder renamed / tracker replaced) through checkpoint.py's
`_after_save_step` seam, as an exception and (once) as os._exit in a separate process. After each,
the tracker names an iteration that loads and resumes the run exactly, the previous checkpoint is
byte-for-byte intact, and the `.tmp` folder left behind is removed by the next save."""

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from megatron_lora.runtime import ParallelLayout
from megatron_lora.training import checkpoint as ckpt
from megatron_lora.training.loop import train
from tests.harness import multirank
from tests.training import _support as S

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITERS = 6  # the optimizer's schedule length in every run here, so losses are comparable
# Where the tracker must point after a crash right after each step of the save of iteration 4.
TRACKER_AFTER = {"shards_written": 2, "renamed": 2, "tracker_replaced": 4}


class _Crash(Exception):
    pass


def _digest(directory: str) -> str:
    """A hash of every file (relative path and bytes) under `directory`."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(directory)):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            h.update(os.path.relpath(path, directory).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def _train(save, iters, **kw):
    layout = ParallelLayout()
    return train([S.model(layout, _weights(save))], S.dataset(), S.run_config(save, iters=iters,
                 **kw), S.optim(ITERS), layout_name=layout.describe())


def _weights(save):
    return os.path.join(os.path.dirname(save), "weights")


@multirank(world_size=1, timeout=400)
def _base(directory, layout=ParallelLayout()):
    """weights/, base/ (a run with its iteration-2 checkpoint) and the losses of a straight run."""
    from megatron_lora.testing.reference import save_weights

    save_weights(S.model(layout), os.path.join(directory, "weights"))
    _train(os.path.join(directory, "base"), 2, save_interval=2)
    straight = _train(os.path.join(directory, "straight"), 5).losses
    with open(os.path.join(directory, "straight.json"), "w") as f:
        json.dump(straight, f)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("crash"))
    _base(directory=directory)
    straight = json.load(open(os.path.join(directory, "straight.json")))
    return directory, {int(k): v for k, v in straight.items()}


def _check_after_crash(save, expected_tracker, straight, digest_before):
    """The tracker names a loadable iteration that resumes the run exactly; the previous
    checkpoint is intact; the next save removes the abandoned .tmp."""
    assert ckpt.read_tracker(save) == expected_tracker
    assert _digest(ckpt.iteration_dir(save, 2)) == digest_before
    resumed = _train(save, expected_tracker + 1)
    assert list(resumed.losses) == [expected_tracker + 1]  # resumed, not started over
    assert resumed.losses[expected_tracker + 1] == straight[expected_tracker + 1]
    assert ckpt.read_tracker(save) == expected_tracker + 1
    assert not [n for n in os.listdir(save) if n.endswith(".tmp")], os.listdir(save)


@multirank(world_size=1, timeout=400)
def test_an_exception_between_save_steps_leaves_a_loadable_tracker(base, tmp_path,
                                                                   layout=ParallelLayout()):
    directory, straight = base
    digest = _digest(ckpt.iteration_dir(os.path.join(directory, "base"), 2))
    os.symlink(os.path.join(directory, "weights"), str(tmp_path / "weights"))
    for point, expected in TRACKER_AFTER.items():
        save = str(tmp_path / point)
        shutil.copytree(os.path.join(directory, "base"), save)

        def crash(step, point=point):
            if step == point:
                raise _Crash(f"killed after {step}")

        ckpt._after_save_step = crash
        try:
            with pytest.raises(_Crash):
                _train(save, 4, save_interval=2)
        finally:
            ckpt._after_save_step = None
        if point == "shards_written":
            assert os.path.isdir(ckpt.iteration_dir(save, 4) + ".tmp")
            assert not os.path.exists(ckpt.iteration_dir(save, 4))
        if point == "renamed":  # in place, but not named by the tracker: never loaded
            assert os.path.isdir(ckpt.iteration_dir(save, 4))
        _check_after_crash(save, expected, straight, digest)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exiting_run(save: str, point: str) -> None:
    """In its own process: resume `save` towards iteration 4 and os._exit(17) right after `point`
    of the iteration-4 save (no finally block, no atexit handler runs)."""
    from megatron_lora import runtime

    runtime.initialize(ParallelLayout(), seed=1234)
    ckpt._after_save_step = lambda step: os._exit(17) if step == point else None
    _train(save, 4, save_interval=2)
    os._exit(0)  # not reached when the crash point is hit


@multirank(world_size=1, timeout=400)
def _check_exited_run(save, expected, straight, digest, layout=ParallelLayout()):
    _check_after_crash(save, expected, straight, digest)


def test_a_process_exit_after_the_shards_leaves_a_loadable_tracker(base, tmp_path):
    directory, straight = base
    digest = _digest(ckpt.iteration_dir(os.path.join(directory, "base"), 2))
    os.symlink(os.path.join(directory, "weights"), str(tmp_path / "weights"))
    save = str(tmp_path / "run")
    shutil.copytree(os.path.join(directory, "base"), save)
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    code = ("from tests.training.test_checkpoint_crash import _exiting_run; "
            f"_exiting_run({save!r}, 'shards_written')")
    log = str(tmp_path / "exiting_run.log")
    with open(log, "w") as f:
        # Its own session: megatron's checkpoint writer processes outlive an os._exit and are
        # ended with it below (output goes to a file, so no pipe stays open through them).
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=400)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    assert rc == 17, open(log).read()[-3000:]
    assert os.path.isdir(ckpt.iteration_dir(save, 4) + ".tmp")  # it died with the shards written
    _check_exited_run(save=save, expected=2, straight=straight, digest=digest)
