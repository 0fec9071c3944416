"""Every ```bash block of docs/ (and of the examples' READMEs in EXAMPLE_PAGES) runs as written;
an example README's memory tables must be its commands' output, row for row.

Each page's `bash` blocks, in page order, are one bash script (`set -euo pipefail`, so any failing
command fails the page) run from a fresh folder that stands for the repository root: it holds links
to the repository's `tools/`, `examples/` and `benchmarks/`, and nothing else, so a page must make
its own inputs (it starts with `python tools/make_tiny_example.py --out tiny`). `python`,
`megatron-lora` and `torchrun` are this environment's. The only change to the environment is
`PET_STANDALONE=1`, torchrun's own variable for `--standalone` (a free rendezvous port per launch),
so that two suites on one machine cannot meet on torchrun's default port.

Commands that cannot run inside the suite (installs, the suite itself, benchmarks of minutes, vLLM
on a GPU) are shown in ```sh blocks instead; `test_sh_blocks_name_what_exists` checks that the
scripts, test folders, extras and benchmark flags they name exist.
"""

from __future__ import annotations

import concurrent.futures
import glob
import json
import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINKED = ("tools", "examples", "benchmarks")


def _blocks(path: str, language: str):
    """The `language` fenced blocks of a markdown file, dedented (a block may sit in a list)."""
    text = open(path, encoding="utf-8").read()
    return [textwrap.dedent(m.group(2)) for m in
            re.finditer(rf"^([ \t]*)```{language}\n(.*?)^\1```", text, re.S | re.M)]


# The examples' READMEs whose bash blocks run here (memory tables of tools/memory_estimate.py;
# the others show commands on the full-size models).
EXAMPLE_PAGES = ("examples/gpt_oss/README.md", "examples/deepseek_v3/README.md")
PAGES = [os.path.relpath(p, ROOT) for p in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
         if _blocks(p, "bash")] + list(EXAMPLE_PAGES)


def _table_rows(text: str) -> list:
    """The data rows of the memory tables (`| name | 1.0 GiB | ... |`) in `text`, in order."""
    return [line.strip() for line in text.splitlines()
            if line.startswith("| ") and line.rstrip().endswith(" GiB |")]


def test_the_pages_with_commands_are_found():
    # the extraction itself works: these pages show runnable commands
    assert {"docs/conversion.md", "docs/peft.md", "docs/training.md", "docs/index.md",
            "docs/lora.md", "examples/gpt_oss/README.md",
            "examples/deepseek_v3/README.md"} <= \
        set(PAGES), PAGES


def _run_page(page: str, folder) -> subprocess.CompletedProcess:
    for name in LINKED:
        os.symlink(os.path.join(ROOT, name), folder / name)
    script = "set -euo pipefail\n" + "\n".join(_blocks(os.path.join(ROOT, page), "bash"))
    # Two pages run side by side: torchrun picks its own port (PET_STANDALONE), and a page's
    # one-process commands (which default to a fixed MASTER_PORT) get a port of the page's own.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
               PET_STANDALONE="1", MASTER_PORT=str(port))
    return subprocess.run(["bash", "-c", script], cwd=str(folder), env=env, capture_output=True,
                          text=True, timeout=int(os.environ.get("MLORA_DOCS_TIMEOUT", "900")))


# What each page's commands leave behind, beyond their exit status.
OUTPUTS = {
    "docs/conversion.md": ["mixtral-mcore/metadata.json", "logits.safetensors",
                           "logits-hf.safetensors", "Mixtral-out/config.json",
                           "Mixtral-out/tokenizer.json", "fp8-mcore/metadata.json",
                           "fp8-out/config.json"],
    "docs/peft.md": ["runs/lora/latest_checkpointed_iteration.txt", "my-adapter/adapter_config.json",
                     "Mixtral-merged/config.json", "logits.safetensors", "completions.jsonl",
                     "imported/metadata.json"],
    "docs/training.md": ["runs/lora/iter_0000010", "runs/lora/loss_curve.png", "runs/tb",
                         "data/train.idx", "data/train_targets.idx", "runs/indexed/iter_0000002",
                         "runs/chat/tokenizer/tokenizer.json", "chat-peft/adapter_config.json"],
    "docs/lora.md": ["dora-adapter/adapter_config.json", "Mixtral-dora-merged/config.json",
                     "prefix-adapter/adapter_model.safetensors", "prefix-completions.jsonl"],
    "docs/index.md": ["parity"],
}


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory):
    """{page: a future of (its folder, its completed run)}. Pages are independent and most of
    their commands are one process, so two run side by side (one core each on 2 cores)."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)

    def run(page):
        folder = tmp_path_factory.mktemp(os.path.basename(page).replace(".", "_"))
        return folder, _run_page(page, folder)

    # the longest pages first, so that the last one to start is short
    order = sorted(PAGES, key=lambda p: -len("".join(_blocks(os.path.join(ROOT, p), "bash"))))
    futures = {page: pool.submit(run, page) for page in order}
    yield futures
    pool.shutdown(wait=True)


def _near_transformers(folder, hf: str, names) -> float:
    """Each `folder/NAME.safetensors` logits file of `names` within compare.reference_bound of
    transformers' logits of `folder/hf` on `folder/tokens.json` (fp32, and fp64 for the bound);
    returns the bound."""
    import torch
    from safetensors.torch import load_file

    from tests.export import _support as S
    from tests.families import _support as F

    tokens = torch.tensor(json.load(open(os.path.join(folder, "tokens.json"))))
    reference = S.in_both(F.hf_logits, os.path.join(folder, hf), tokens)
    for name in names:
        ours = load_file(os.path.join(folder, f"{name}.safetensors"))["logits"]
        bound = S.assert_near_reference(ours, reference, f"{name} vs transformers on {hf}")
    return bound


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("page", PAGES)
def test_docs_page_commands_run_as_written(page, page_runs):
    tmp_path, done = page_runs[page].result()
    assert done.returncode == 0, (
        f"{page}: a command failed (exit {done.returncode})\n--- stdout\n{done.stdout[-3000:]}"
        f"\n--- stderr\n{done.stderr[-4000:]}")
    missing = [p for p in OUTPUTS.get(page, []) if not (tmp_path / p).exists()]
    assert not missing, f"{page}: its commands ran but did not write {missing}"
    if page == "docs/conversion.md":
        # the two logits commands (mcore at TP2xEP2+SP, HF folder at PP2), and the FP8 folder's
        # (converted at 1 rank, read directly at TP2), each within compare.reference_bound of
        # transformers' on the folder they stand for (fp8-out: the FP8 weights dequantised), so
        # each pair within twice that bound, which the page's printed difference must respect
        for folder, pair, line in (
                ("tiny/hf", ("logits", "logits-hf"), "largest difference"),
                ("fp8-out", ("logits-fp8", "logits-fp8-hf"),
                 "FP8 folder, converted vs --load-hf at TP2")):
            bound = _near_transformers(tmp_path, folder, pair)
            (diff,) = re.findall(rf"{line}: (\S+)", done.stdout)
            assert float(diff) <= 2 * bound, (line, diff, bound)
        assert "quantization_config in fp8-out/config.json: False" in done.stdout, done.stdout
    if page == "docs/peft.md":
        assert re.search(r"PeftModel\w* with [1-9]\d* LoRA parameters", done.stdout), done.stdout
        (line,) = open(tmp_path / "completions.jsonl").read().splitlines()
        out = json.loads(line)
        assert out["prompt"] == "The capital of France is" and 1 <= len(out["token_ids"]) <= 16
    if page == "docs/training.md":
        config = json.load(open(tmp_path / "chat-peft/adapter_config.json"))
        assert set(config["trainable_token_indices"]) == {"embed_tokens", "lm_head"}, config
        assert len(config["trainable_token_indices"]["embed_tokens"]) == 2, config
    if page == "docs/lora.md":
        assert json.load(open(tmp_path / "dora-adapter/adapter_config.json"))["use_dora"] is True
        prefix = json.load(open(tmp_path / "prefix-adapter/adapter_config.json"))
        assert (prefix["peft_type"], prefix["num_virtual_tokens"]) == ("PREFIX_TUNING", 10)
        (line,) = open(tmp_path / "prefix-completions.jsonl").read().splitlines()
        assert len(json.loads(line)["token_ids"]) == 8
    if page == "docs/index.md":
        assert "all layouts agree with the single-rank run" in done.stdout, done.stdout[-2000:]
    if page.startswith("examples/"):
        # the README's memory tables are its commands' output, row for row
        shown = _table_rows(open(os.path.join(ROOT, page), encoding="utf-8").read())
        assert shown and shown == _table_rows(done.stdout), done.stdout


def test_a_failing_command_fails_its_page(tmp_path, monkeypatch):
    """The runner does not hide a failure: a page whose block has a mistyped flag fails."""
    page = tmp_path / "docs" / "broken.md"
    page.parent.mkdir()
    page.write_text("# broken\n```bash\necho first\nmegatron-lora data-preview --data-path d.jsonl --tokenizer byte --seq-length 8 --no-such-flag\n"
                    "echo never\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    for name in LINKED:
        (tmp_path / name).mkdir()
    run = tmp_path / "run"
    run.mkdir()
    done = _run_page("docs/broken.md", run)
    assert done.returncode == 2 and "first" in done.stdout and "never" not in done.stdout
    assert "--no-such-flag" in done.stderr


def test_sh_blocks_name_what_exists():
    """The commands the suite cannot run name scripts, folders, extras and flags that exist."""
    setup = open(os.path.join(ROOT, "setup.py")).read()
    problems, seen = [], 0
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        for block in _blocks(path, "sh"):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                line = line.split(" #", 1)[0].strip()
                if not line:
                    continue
                seen += 1
                words = line.split()
                for word in words:
                    if re.match(r"(benchmarks|tools|tests|examples)/", word) and \
                            not os.path.exists(os.path.join(ROOT, word)):
                        problems.append(f"{path}: {word} does not exist")
                script = next((w for w in words if re.match(r"benchmarks/\S+\.py$", w)), None)
                if script and os.path.exists(os.path.join(ROOT, script)):
                    source = open(os.path.join(ROOT, script)).read()
                    problems += [f"{path}: {script} has no {w}" for w in words
                                 if w.startswith("--") and f'"{w}"' not in source]
                for extra in re.findall(r"\.\[([\w,]+)\]", line):
                    problems += [f"{path}: setup.py has no extra {e!r}" for e in extra.split(",")
                                 if f'"{e}"' not in setup]
                if words[:2] == ["make", "test"]:
                    assert "make test" in open(os.path.join(ROOT, "README.md")).read()
    assert seen >= 5 and not problems, problems
