"""megatron-lora's argument errors (cli/parser.py): a mistyped flag or command gets the closest
name; the error is one line and a pointer to --help (no usage block); under torchrun only rank 0
prints it, every rank exits 2."""

import pytest

from megatron_lora.cli import build_parser

REQUIRED = ["--load", "x", "--data-path", "d", "--tokenizer", "byte", "--seq-length", "8",
            "--global-batch-size", "2", "--train-iters", "1"]


def _error(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv,line", [
    (["train", *REQUIRED, "--lora-rnk", "8"],
     "megatron-lora train: error: unrecognized arguments: --lora-rnk 8 (did you mean "
     "--lora-rank for --lora-rnk?)"),
    (["train", *REQUIRED, "--lr-warmup=3"],
     "megatron-lora train: error: unrecognized arguments: --lr-warmup=3 (did you mean "
     "--lr-warmup-iters for --lr-warmup?)"),
    (["trian"], "(did you mean 'train'?)"),
    (["convert", "hf2mcore"], "(did you mean 'hf-to-mcore'?)"),
])
def test_a_misspelling_gets_the_closest_name_in_one_line(capsys, monkeypatch, argv, line):
    monkeypatch.delenv("RANK", raising=False)
    err = _error(capsys, argv)
    lines = err.splitlines()
    assert len(lines) == 2 and "usage:" not in err, err
    assert lines[0] == line or lines[0].endswith(line), err
    assert lines[1].endswith("--help lists its flags)"), err


def test_nothing_close_gets_no_suggestion(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    err = _error(capsys, ["train", *REQUIRED, "--zzzzqqq"])
    assert "unrecognized arguments: --zzzzqqq\n" in err and "did you mean" not in err, err


def test_under_torchrun_the_error_is_printed_once(tiny_example, tmp_path):
    """2 ranks under torchrun: a mistyped flag, and a layout logits refuses (every rank finds
    it before any collective), each printed once; the launch fails."""
    from tests.export import _support as S

    hf = tiny_example(tmp_path / "tiny", 4) + "/hf"
    tokens = S.write_tokens(str(tmp_path / "tokens.json"), __import__("torch").zeros(2, 4).long())
    cases = [(["train", *REQUIRED, "--lora-rnk", "8"], "did you mean --lora-rank"),
             (["logits", "--load-hf", hf, "--tokens", tokens, "--out", str(tmp_path / "o"),
               "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
              "megatron-lora logits: error: ")]
    for argv, needle in cases:
        done = S.cli(*argv, nproc=2)
        assert done.returncode != 0
        assert done.stderr.count(needle) == 1, done.stderr[-3000:]
        assert not (tmp_path / "o").exists()
