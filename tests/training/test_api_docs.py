"""The Python API program in docs/training.md (## API) runs as written: one process with the
torchrun environment of one rank, `hf_dir` pointing at the tiny Mixtral instead of 8x7B."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HF_LINE = 'hf_dir = "Mixtral-8x7B-v0.1"'


def _api_program() -> str:
    with open(os.path.join(ROOT, "docs", "training.md")) as f:
        text = f.read()
    section = text.split("\n## API\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return block


def test_the_api_program_of_the_docs_runs(tmp_path, tiny_example):
    tiny = tiny_example(tmp_path / "tiny", samples=1)
    program = _api_program()
    assert program.count(HF_LINE) == 1, "the docs' program no longer names its HF folder so"
    script = tmp_path / "lora_api.py"
    script.write_text(program.replace(HF_LINE, f"hf_dir = {os.path.join(tiny, 'hf')!r}"))
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29850 + os.getpid() % 100),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"trainable params: [\d,]+ \|\| all params: [\d,]+", done.stdout), done.stdout
    assert re.search(r"logits \[2, 16, \d+\]; [\d,]+ of [\d,]+ parameters train", done.stdout), \
        done.stdout
