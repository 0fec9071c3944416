"""Every command checks its output before any work: it never destroys an input, refuses what it
could not write (exit 2, one message naming the flag, no traceback), and cleans the partial
folders an interrupted run of its own left behind -- and nothing else."""

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import torch

from megatron_lora.cli import main
from megatron_lora.convert import atomic
from megatron_lora.convert.outputs import OutputError, check_output, overlap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def art(tmp_path_factory, tiny_example):
    """A tiny HF Mixtral, its torch_dist conversion, an adapter checkpoint (random factors on
    linear_qkv), the same adapter as a PEFT folder, token ids and a JSONL data file."""
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.export.adapter_ckpt import write_adapter_checkpoint
    from megatron_lora.export.table import KIND_BY_NAME, factor_shapes
    from megatron_lora.export.to_peft import export_peft
    from megatron_lora.lora.model import LoraConfig

    root = tmp_path_factory.mktemp("outputs")
    tiny_example(root, samples=24, mcore=True)
    p = {"root": str(root), "hf": str(root / "hf"), "data": str(root / "data.jsonl"),
         "mcore": str(root / "mcore"), "adapter": str(root / "adapter"),
         "peft": str(root / "peft"), "tokens": str(root / "tokens.json")}
    info, _, _ = open_hf(p["hf"])
    kind = KIND_BY_NAME["linear_qkv"]
    a_shape, b_shape = factor_shapes(info, kind, 2)
    gen = torch.Generator().manual_seed(0)

    def factors(site):
        return (torch.randn(a_shape[kind.lead:], generator=gen),
                torch.randn(b_shape[kind.lead:], generator=gen))

    write_adapter_checkpoint(p["adapter"], info, {"linear_qkv": 2}, factors,
                             LoraConfig(r=2, lora_alpha=4, target_modules=["linear_qkv"]),
                             torch.float32)
    export_peft(p["adapter"], p["peft"], hf_config=p["hf"])
    json.dump([[1, 2, 3, 4], [5, 6, 7, 8]], open(p["tokens"], "w"))
    return p


def _digest(path):
    """A hash of a file or of a folder tree (names and bytes)."""
    h = hashlib.sha256()
    if os.path.isfile(path):
        h.update(open(path, "rb").read())
        return h.hexdigest()
    for d, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for name in sorted(files):
            f = os.path.join(d, name)
            h.update(os.path.relpath(f, path).encode())
            h.update(open(f, "rb").read())
    return h.hexdigest()


# command -> (argv with {in} for the input that the output will collide with, the input's key)
COMMANDS = {
    "hf-to-mcore": (["convert", "hf-to-mcore", "--hf-dir", "{in}", "--no-progress"], "hf"),
    "mcore-to-hf": (["convert", "mcore-to-hf", "--load", "{in}", "--no-progress"], "mcore"),
    "export-peft": (["export", "peft", "--adapter", "{in}", "--load-hf", "{hf}"], "adapter"),
    "export-hf-load": (["export", "hf", "--load", "{in}", "--adapter", "{adapter}", "--merge",
                        "--no-progress"], "mcore"),
    "export-hf-adapter": (["export", "hf", "--load", "{mcore}", "--adapter", "{in}", "--merge",
                           "--no-progress"], "adapter"),
    "import-peft": (["import", "peft", "--adapter", "{in}", "--load-hf", "{hf}"], "peft"),
}


def _argv(art, command, victim, save, *extra):
    argv, _ = COMMANDS[command]
    return [a.format(**{"in": victim, **art}) for a in argv] + ["--save", save, *extra]


def _run(argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


def _no_debris(directory):
    return [n for n in os.listdir(directory) if ".partial-" in n or ".old-" in n
            or n.startswith(".megatron-lora-probe-")]


@pytest.mark.parametrize("relation", ["same", "inside", "contains", "symlink"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_output_overlapping_an_input_is_refused_and_the_input_kept(art, tmp_path, capsys,
                                                                   command, relation):
    box = tmp_path / "box"
    box.mkdir()
    victim = str(box / "in")
    shutil.copytree(art[COMMANDS[command][1]], victim)
    before = _digest(str(box))
    save = {"same": victim, "inside": os.path.join(victim, "out"), "contains": str(box),
            "symlink": str(tmp_path / "link")}[relation]
    if relation == "symlink":
        os.symlink(victim, save)
    code, err = _run(_argv(art, command, victim, save, "--overwrite"), capsys)
    assert code == 2, err
    flag = COMMANDS[command][0][COMMANDS[command][0].index("{in}") - 1]
    assert f"--save {save}" in err and f"the input {flag} {victim}" in err, err
    assert {"same": " is the input", "inside": " is inside the input",
            "contains": " contains the input", "symlink": "through a symlink"}[relation] in err
    assert "Traceback" not in err
    assert _digest(str(box)) == before  # byte for byte
    assert not _no_debris(str(box)) and not _no_debris(str(tmp_path))


@pytest.fixture
def immutable(tmp_path):
    """A folder nobody can write in, root included (chattr +i; chmod 0o555 where not root)."""
    d = tmp_path / "locked"
    d.mkdir()
    (d / "keep.txt").write_text("keep")
    if os.geteuid() == 0:
        done = subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode == 0
    else:
        os.chmod(d, 0o555)
        done = True
    try:
        open(d / "probe", "w").close()
        os.remove(d / "probe")
        writable = True
    except OSError:
        writable = False
    if not done or writable:
        subprocess.run(["chattr", "-i", str(d)], capture_output=True)
        pytest.skip("cannot make a folder unwritable here (no chattr +i as root)")
    yield str(d)
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(d)], check=True)
    os.chmod(d, 0o755)


@pytest.mark.parametrize("command", ["hf-to-mcore", "mcore-to-hf", "export-peft",
                                     "export-hf-adapter", "import-peft"])
def test_unwritable_or_file_parent_is_refused_before_work(art, tmp_path, capsys, immutable,
                                                          command):
    victim = art[COMMANDS[command][1]]
    code, err = _run(_argv(art, command, victim, os.path.join(immutable, "new", "out")), capsys)
    assert code == 2 and f"cannot create anything in {immutable}" in err, err
    assert os.listdir(immutable) == ["keep.txt"]

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    code, err = _run(_argv(art, command, victim, str(blocker / "out")), capsys)
    assert code == 2 and f"{blocker} is a file" in err, err
    code, err = _run(_argv(art, command, victim, str(blocker)), capsys)
    assert code == 2 and "is an existing file, not a folder" in err, err
    assert blocker.read_text() == "x" and "Traceback" not in err


def test_overwrite_onto_an_immutable_folder_is_refused_before_work(art, tmp_path, capsys,
                                                                   immutable):
    code, err = _run(_argv(art, "hf-to-mcore", art["hf"], immutable, "--overwrite"), capsys)
    assert code == 2 and "cannot write in this folder" in err and "--save" in err, err
    assert os.listdir(immutable) == ["keep.txt"] and not _no_debris(str(tmp_path))


def test_existing_output_needs_overwrite_and_is_then_replaced_cleanly(art, tmp_path, capsys,
                                                                      monkeypatch):
    save = tmp_path / "out"
    save.mkdir()
    (save / "old.txt").write_text("old")
    code, err = _run(_argv(art, "export-peft", art["adapter"], str(save)), capsys)
    assert code == 2 and "already exists; pass --overwrite" in err, err
    assert (save / "old.txt").read_text() == "old"
    code, err = _run(_argv(art, "export-peft", art["adapter"], str(save), "--overwrite"), capsys)
    assert code == 0, err
    assert sorted(os.listdir(save)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not _no_debris(str(tmp_path))
    # Where the file system cannot swap two folders in one step, the old one is moved aside.
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    (save / "old.txt").write_text("old")
    code, err = _run(_argv(art, "export-peft", art["adapter"], str(save), "--overwrite"), capsys)
    assert code == 0, err
    assert sorted(os.listdir(save)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not _no_debris(str(tmp_path))


_KILLED_WRITER = """
import sys, time
from megatron_lora.convert.atomic import atomic_directory
with atomic_directory(sys.argv[1]) as tmp:
    open(tmp + "/big.bin", "wb").write(b"0" * 1000)
    print(tmp, flush=True)
    time.sleep(600)
"""


def _killed_partial(save):
    """The partial folder of a writer that was killed with SIGKILL mid-write."""
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, save], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT)
    try:
        tmp = proc.stdout.readline().strip()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert os.path.isfile(os.path.join(tmp, "big.bin")), tmp
    return tmp


def test_stale_partial_of_a_killed_run_is_cleaned_and_look_alikes_kept(art, tmp_path, capsys):
    save = str(tmp_path / "mcore")
    stale = _killed_partial(save)
    # Look-alikes that are not ours to remove: no marker, a marker of a live process, a marker
    # from another machine, another output's partial, and a file.
    foreign = tmp_path / ".mcore.partial-foreign"
    foreign.mkdir()
    (foreign / "data.bin").write_text("not ours")
    live = tmp_path / ".mcore.partial-live"
    shutil.copytree(stale, live)
    marker = json.load(open(live / atomic.MARKER))
    json.dump(dict(marker, pid=os.getpid(), start_time=atomic._start_time(os.getpid())),
              open(live / atomic.MARKER, "w"))
    remote = tmp_path / ".mcore.partial-remote"
    shutil.copytree(stale, remote)
    json.dump(dict(marker, host="another-host"), open(remote / atomic.MARKER, "w"))
    other = tmp_path / ".mcore2.partial-x"
    shutil.copytree(stale, other)
    (tmp_path / ".mcore.partial-file").write_text("a file")

    code, err = _run(_argv(art, "hf-to-mcore", art["hf"], save), capsys)
    assert code == 0, err
    assert f"removed stale partial output {stale} from an interrupted run" in err
    assert not os.path.exists(stale)
    assert sorted(os.listdir(tmp_path)) == sorted([
        "mcore", ".mcore.partial-foreign", ".mcore.partial-live", ".mcore.partial-remote",
        ".mcore2.partial-x", ".mcore.partial-file"])
    assert (foreign / "data.bin").read_text() == "not ours"
    assert atomic.MARKER not in os.listdir(save)  # the marker never reaches the output


def test_old_output_of_an_interrupted_overwrite_is_kept_when_it_is_the_only_copy(tmp_path):
    save = str(tmp_path / "out")
    stale = _killed_partial(save)
    old = tmp_path / ".out.old-abc"
    os.rename(stale, old)  # what the move-aside overwrite leaves when killed between renames
    messages = []
    assert atomic.clean_stale_partials(save, log=messages.append) == []
    assert old.is_dir() and "left in place" in messages[0]
    os.mkdir(save)  # once the output is in place again, the old copy is debris
    assert atomic.clean_stale_partials(save, log=messages.append) == [str(old)]


def test_overlap_sees_through_symlinks_and_bind_like_aliases(tmp_path):
    (tmp_path / "m" / "sub").mkdir(parents=True)
    os.symlink(tmp_path / "m", tmp_path / "alias")
    m = str(tmp_path / "m")
    assert overlap(str(tmp_path / "alias"), m) == "is"
    assert overlap(str(tmp_path / "alias" / "sub" / "new"), m) == "is inside"
    assert overlap(str(tmp_path), str(tmp_path / "alias" / "sub")) == "contains"
    assert overlap(str(tmp_path / "n"), m) is None
    assert overlap(str(tmp_path / "mm"), m) is None  # a common prefix is not containment
    with pytest.raises(OutputError, match="--out: empty output path"):
        check_output("", flag="--out")


def _logits(art, out, *extra):
    return ["logits", "--load", art["mcore"], "--tokens", art["tokens"], "--out", out, *extra]


def test_logits_out_is_checked_before_the_run(art, tmp_path, capsys):
    code, err = _run(_logits(art, str(tmp_path)), capsys)
    assert code == 2 and f"--out {tmp_path} is an existing folder" in err, err
    existing = tmp_path / "logits.safetensors"
    existing.write_bytes(b"previous")
    code, err = _run(_logits(art, str(existing)), capsys)
    assert code == 2 and "already exists; pass --overwrite" in err, err
    assert existing.read_bytes() == b"previous"
    before = _digest(art["tokens"])
    code, err = _run(_logits(art, art["tokens"], "--overwrite"), capsys)
    assert code == 2 and "is the input --tokens" in err, err
    code, err = _run(_logits(art, os.path.join(art["mcore"], "l.safetensors")), capsys)
    assert code == 2 and "is inside the input --load" in err, err
    code, err = _run(_logits(art, str(existing / "x.safetensors")), capsys)
    assert code == 2 and f"{existing} is a file" in err, err
    assert _digest(art["tokens"]) == before and "Traceback" not in err


def test_logits_overwrite_replaces_the_file_without_debris(art, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "logits.safetensors"
    out.write_bytes(b"previous")
    proc = subprocess.run([sys.executable, "-m", "megatron_lora", *_logits(art, str(out)),
                           "--overwrite"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(_free_port())))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(load_file(str(out))) == ["logits"]
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o666 & ~_umask())
    assert os.listdir(tmp_path) == ["logits.safetensors"]


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _train(art, save, *extra):
    return ["train", "--load-hf", art["hf"], "--data-path", art["data"], "--tokenizer", "byte",
            "--seq-length", "16", "--global-batch-size", "2", "--train-iters", "2",
            "--lora-rank", "2", "--save", save, *extra]


@pytest.fixture
def single_rank_env(monkeypatch):
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                 ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29572")):
        monkeypatch.setenv(k, v)


def test_train_save_is_checked_before_training(art, tmp_path, capsys, immutable,
                                               single_rank_env):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    cases = [
        (str(blocker), "--save", "is an existing file, not a folder"),
        (str(blocker / "run"), "--save", f"{blocker} is a file"),
        (immutable, "--save", "cannot write in this folder"),
        (os.path.join(immutable, "run"), "--save", f"cannot create anything in {immutable}"),
        (art["hf"], "--save", "is the input --load-hf"),
        (os.path.join(art["hf"], "run"), "--save", "is inside the input --load-hf"),
        (art["root"], "--save", "contains the input"),
    ]
    before = _digest(art["hf"]), _digest(art["data"])
    for save, flag, needle in cases:
        code, err = _run(_train(art, save), capsys)
        assert code == 2 and f"{flag} " in err and needle in err, (save, err)
        assert "Traceback" not in err and "iteration" not in err
    code, err = _run(_train(art, str(tmp_path / "run"), "--tensorboard-dir", str(blocker)), capsys)
    assert code == 2 and "--tensorboard-dir" in err and "not a folder" in err, err
    assert (_digest(art["hf"]), _digest(art["data"])) == before
    assert os.listdir(immutable) == ["keep.txt"] and not os.path.exists(tmp_path / "run")


def test_train_bad_save_fails_on_every_rank_under_torchrun(art, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    # Every rank finds the problem; rank 0 prints it and exits 2, the other waits for torchrun
    # to stop it (so that rank 0 is not stopped before it printed): the message appears once.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--monitor-interval", "15", "--master-port", str(_free_port()), "-m", "megatron_lora",
           *_train(art, str(blocker))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode != 0
    assert proc.stderr.count("megatron-lora train: error: --save") == 1, proc.stderr[-3000:]
    assert proc.stderr.count("exitcode  : 2 ") == 1, proc.stderr[-3000:]
    # torchrun reports the failure with its own traceback; the ranks print none.
    assert not re.search(r'File ".*megatron_lora/', proc.stderr), proc.stderr[-3000:]
    assert "iteration" not in proc.stdout and blocker.read_text() == "x"
