"""GPU acceptance: every family's tiny model through every command on one GPU, against CPU and HF.

    python benchmarks/gpu/acceptance.py prepare DIR     # here, on CPU: models, data, CPU losses
    python benchmarks/gpu/acceptance.py run DIR         # there, on the GPU (run.sh does it)

`prepare` writes, for each family of tools/make_tiny_example.py (--family), a tiny random
transformers model with its tokenizer and data in DIR/FAMILY, and trains each run of RUNS on the
CPU (fp32, one rank), keeping its losses in DIR/FAMILY/cpu_losses.json. `run` does, in one
process, for every family (each part under its own time limit, every part attempted whatever
failed before it):
    convert   `convert hf-to-mcore` of the tiny model
    train     `train` 10 iterations in fp32 on the GPU from the conversion (LoRA r=8 with dropout
              and rsLoRA on every linear kind, experts included): the losses equal the CPU run's
              within relative 1e-4 (fp32 both; the order of summation differs: see LOSS_RTOL)
    logits    `logits` of the base on the GPU against transformers' on the GPU (fp32): every
              |diff| within compare.reference_bound, 11 x transformers' own fp32 rounding on the
              GPU (its fp32 logits against its fp64 ones)
    peft      `export peft` of the trained adapter, loaded by PEFT onto transformers' model on the
              GPU: its logits equal `logits --adapter`'s within the same bound
    generate  greedy `generate` with the adapter (8 new tokens) gives transformers + PEFT's
              generate(do_sample=False) token for token
and then once each on Mixtral: DoRA, prefix tuning, new tokens (--add-special-tokens) and the NF4
base (--base-quantization nf4) train 4 iterations on the GPU with the CPU run's losses (relative
1e-4; the NF4 base is bitsandbytes' values on both: its dequantisation agrees to fp32 rounding).
Prints one pass/fail table and one JSON line ({"rows": [...], "passed": n, "failed": n}), and
writes each row to DIR/acceptance.jsonl as it is known, so a call cut short keeps its rows.
`--families` and `--device cpu` narrow a run (the suite runs one family on CPU as a smoke test).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import shutil
import signal
import socket
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)

TRAIN_ITERS = 10
VARIANT_ITERS = 4
# Losses of the same run on the GPU and on the CPU (fp32, lr 2e-3): a loss is a mean of
# log-softmaxes, which move by at most twice the largest change of a logit, and the logits of
# two fp32 evaluation orders are within compare.reference_bound (~1e-5 relative to the largest
# logit at these sizes): 2e-5 relative at step 1. Later steps add the adapters' drift: Adam may
# move an element whose gradient cancels to within its rounding by up to 2 lr (compare.
# adam_step_bound) the other way, but such an element's gradient is itself at rounding size,
# so the loss moves by its gradient times the drift, second order. 1e-4 leaves 5x for that;
# a wrong gradient moves a loss by lr-sized steps (~1e-3 relative).
LOSS_RTOL = 1e-4
NEW_TOKENS = 8
PART_SECONDS = 120
TOKENS = [[1, 5, 9, 14, 20, 27, 35, 44, 54, 65, 77, 90]]
LORA = ["--lora-rank", "8", "--lora-alpha", "16", "--lora-dropout", "0.1", "--lora-use-rslora",
        "--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
# name -> (family, extra train flags, iterations): the runs `prepare` trains on CPU.
RUNS = {
    "lora": (None, LORA, TRAIN_ITERS),
    "dora": ("mixtral", [*LORA, "--lora-use-dora"], VARIANT_ITERS),
    "prefix": ("mixtral", ["--peft-type", "prefix", "--num-virtual-tokens", "4"], VARIANT_ITERS),
    "new_tokens": ("mixtral", [*LORA[:6], "--add-special-tokens", "<|im_start|>",
                               "--tokenizer", "hf"], VARIANT_ITERS),
    "nf4": ("mixtral", [*LORA[:6], "--base-quantization", "nf4"], VARIANT_ITERS),
}


def _tiny_maker():
    spec = importlib.util.spec_from_file_location(
        "make_tiny_example", os.path.join(REPO, "tools", "make_tiny_example.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def families() -> list:
    return sorted(_tiny_maker().FAMILIES)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def megatron_lora(argv: list, cwd: str) -> str:
    """One `megatron-lora` command in this process (one rank); returns what it printed. Raises
    RuntimeError with the output when it exits non-zero."""
    from megatron_lora import cli

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    out = io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = cli.main(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(here)
    if code:
        raise RuntimeError(f"megatron-lora {' '.join(argv[:2])} exited {code}:\n"
                           f"{out.getvalue()[-2000:]}")
    return out.getvalue()


def train_args(run: str, load: list, save: str) -> list:
    extra = list(RUNS[run][1])
    tokenizer = ["--tokenizer", "byte"] if "--tokenizer" not in extra else []
    return ["train", *load, "--data-path", "data.jsonl", *tokenizer, "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", str(RUNS[run][2]), "--lr", "2e-3", "--log-interval", "1",
            "--seed", "7", "--save", save, *extra]


def losses(folder: str) -> list:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["lm loss"] for r in rows if "lm loss" in r]


def runs_of(family: str) -> list:
    return [name for name, (only, _, _) in RUNS.items() if only in (None, family)]


def prepare(directory: str, names: list) -> None:
    """Tiny models and data, and the CPU losses of every run (this machine's CPU)."""
    maker = _tiny_maker()
    for family in names:
        out = os.path.join(directory, family)
        os.makedirs(out, exist_ok=True)
        maker.make_model(os.path.join(out, "hf"), family=family)
        texts = maker.make_data(os.path.join(out, "data.jsonl"), 64)
        maker.make_tokenizer(os.path.join(out, "hf"), texts + [maker.TOKENIZER_TEXT],
                             vocab_size=maker.TINY["vocab_size"], family=family)
        reference = {}
        for run in runs_of(family):
            save = os.path.join("cpu_runs", run)
            megatron_lora(train_args(run, ["--load-hf", "hf"], save), out)
            reference[run] = losses(os.path.join(out, save))
        with open(os.path.join(out, "cpu_losses.json"), "w") as f:
            json.dump(reference, f)
        shutil.rmtree(os.path.join(out, "cpu_runs"))  # only the losses travel to the GPU
        print(f"prepared {family}: {', '.join(f'{k} {v[-1]:.4f}' for k, v in reference.items())}",
              flush=True)


class _PartTimeout(Exception):
    pass


@contextlib.contextmanager
def _limit(seconds: int):
    def expire(*_):
        raise _PartTimeout(f"over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _close(a, b, rtol: float) -> tuple:
    worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)) if a else float("inf")
    return len(a) == len(b) and worst <= rtol, worst


def _hf_model(folder: str, device):
    import torch
    from transformers import AutoModelForCausalLM

    # eager experts: transformers' grouped_mm experts take no fp64 (see _their_logits)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                experts_implementation="eager").to(device).eval()


def _logits_file(path: str):
    from safetensors.torch import load_file

    return load_file(path)["logits"].float()


def _their_logits(model, tokens) -> tuple:
    """The transformers (or PEFT) model's logits [B, S, V] in fp32 and in fp64 (the same
    weights, `.double()`); the model is fp32 again afterwards."""
    import torch

    with torch.no_grad():
        fp32 = model(tokens).logits.float()
        fp64 = model.double()(tokens).logits.double()
    model.float()
    return fp32, fp64


def _logits_close(ours, theirs) -> tuple:
    """ours [B, S, V] fp32 against transformers' (fp32, fp64): every element within
    compare.reference_bound (11 x transformers' own fp32 rounding)."""
    from megatron_lora.testing import compare

    fp32, fp64 = theirs
    bound = compare.reference_bound(fp32, fp64)
    diff = (ours.to(fp32.device) - fp32).abs().max().item()
    return diff <= bound, f"max |diff| {diff:.2e} (bound {bound:.2e})"


def check_family(directory: str, family: str, device, record) -> None:
    """Every part for one family; `record(family, part, ok, detail)` for each."""
    import torch

    out = os.path.join(directory, family)
    with open(os.path.join(out, "cpu_losses.json")) as f:
        reference = json.load(f)
    with open(os.path.join(out, "tokens.json"), "w") as f:
        json.dump(TOKENS, f)
    with open(os.path.join(out, "prompts.jsonl"), "w") as f:
        f.write(json.dumps({"prompt": "The capital of France is"}) + "\n")
    models = {}  # the PEFT model, for generate
    done = {}  # part -> whether it ran to its comparison (what later parts need)

    def part(name, fn, needs=()):
        if any(not done.get(n) for n in needs):
            record(family, name, False, f"skipped: {', '.join(needs)} did not run")
            return
        started = time.time()
        try:
            with _limit(PART_SECONDS):
                ok, detail = fn()
            done[name] = True
        except Exception as exc:  # noqa: BLE001 - a failed part is a row, never the end
            ok, detail = False, f"{type(exc).__name__}: {str(exc)[-600:]}"
            traceback.print_exc()
        record(family, name, ok, f"{detail} ({time.time() - started:.1f} s)")

    def convert():
        megatron_lora(["convert", "hf-to-mcore", "--hf-dir", "hf", "--save", "mcore",
                       "--overwrite", "--no-progress"], out)
        return True, "converted"

    def train(run):
        def go():
            load = ["--load-hf", "hf"] if run == "new_tokens" else ["--load", "mcore"]
            save = os.path.join("gpu_runs", run)
            shutil.rmtree(os.path.join(out, save), ignore_errors=True)  # ours: a fresh run
            megatron_lora(train_args(run, load, save), out)
            ok, worst = _close(losses(os.path.join(out, "gpu_runs", run)), reference[run],
                               LOSS_RTOL)
            return ok, f"losses within rel {worst:.2e} of the CPU run's (bound {LOSS_RTOL:g})"
        return go

    def logits():
        megatron_lora(["logits", "--load-hf", "hf", "--tokens", "tokens.json",
                       "--out", "base_logits.safetensors", "--overwrite"], out)
        theirs = _their_logits(_hf_model(os.path.join(out, "hf"), device),
                               torch.tensor(TOKENS, device=device))
        ok, diff = _logits_close(_logits_file(os.path.join(out, "base_logits.safetensors")), theirs)
        return ok, f"{diff} vs transformers"

    def peft():
        from peft import PeftModel

        megatron_lora(["export", "peft", "--adapter", "gpu_runs/lora", "--load-hf", "hf",
                       "--save", "peft", "--overwrite"], out)
        megatron_lora(["logits", "--load-hf", "hf", "--adapter", "gpu_runs/lora",
                       "--tokens", "tokens.json", "--out", "lora_logits.safetensors",
                       "--overwrite"], out)
        model = PeftModel.from_pretrained(_hf_model(os.path.join(out, "hf"), device),
                                          os.path.join(out, "peft")).eval()
        theirs = _their_logits(model, torch.tensor(TOKENS, device=device))
        ok, diff = _logits_close(_logits_file(os.path.join(out, "lora_logits.safetensors")), theirs)
        models["peft"] = model
        return ok, f"PEFT loaded it; {diff} vs logits --adapter"

    def generate():
        from transformers import AutoTokenizer

        megatron_lora(["generate", "--load-hf", "hf", "--adapter", "gpu_runs/lora",
                       "--tokenizer", "hf", "--prompts", "prompts.jsonl", "--out", "gen.jsonl",
                       "--max-new-tokens", str(NEW_TOKENS), "--overwrite"], out)
        with open(os.path.join(out, "gen.jsonl")) as f:
            ours = json.loads(f.readline())
        tok = AutoTokenizer.from_pretrained(os.path.join(out, "hf"))
        ids = tok("The capital of France is", return_tensors="pt").input_ids.to(device)
        with torch.no_grad():
            theirs = models["peft"].generate(input_ids=ids, do_sample=False,
                                                  max_new_tokens=NEW_TOKENS)[0, ids.shape[1]:]
        ours_ids, theirs_ids = ours["token_ids"], theirs.tolist()
        # Both stop at the end-of-sequence id (kept); transformers may pad after it.
        return ours_ids == theirs_ids[:len(ours_ids)], f"{len(ours_ids)} tokens {ours_ids}"

    part("convert", convert)
    for run in runs_of(family):
        part(f"train {run}", train(run), needs=("convert",))
    part("logits", logits)
    part("peft", peft, needs=("train lora",))
    part("generate", generate, needs=("peft",))
    models.clear()


def run(directory: str, names: list, device_name: str) -> int:
    import torch

    if device_name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("acceptance.py run: no CUDA device (use --device cpu for a smoke run)")
    if device_name == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    device = torch.device("cuda", 0) if device_name == "cuda" else torch.device("cpu")
    rows = []
    log = os.path.join(directory, "acceptance.jsonl")
    open(log, "w").close()

    def record(family, part, ok, detail):
        row = {"family": family, "part": part, "ok": bool(ok), "detail": detail}
        rows.append(row)
        with open(log, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{'PASS' if ok else 'FAIL'}  {family:12s} {part:18s} {detail}", flush=True)

    started = time.time()
    for family in names:
        check_family(directory, family, device, record)
    print(f"\n{'family':12s} {'part':18s} result")
    for row in rows:
        print(f"{row['family']:12s} {row['part']:18s} {'pass' if row['ok'] else 'FAIL'}")
    passed = sum(r["ok"] for r in rows)
    print(json.dumps({"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                      "rows": rows, "passed": passed, "failed": len(rows) - passed,
                      "seconds": round(time.time() - started, 1)}))
    return 0 if passed == len(rows) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["prepare", "run"])
    p.add_argument("directory")
    p.add_argument("--families", nargs="+", default=None, help="default: every family")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="run: where")
    args = p.parse_args(argv)
    names = args.families or families()
    unknown = sorted(set(names) - set(families()))
    if unknown:
        raise SystemExit(f"acceptance.py: unknown families {unknown} (choose from {families()})")
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.action == "prepare":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the reference is the CPU's
        prepare(args.directory, names)
        return 0
    return run(args.directory, names, args.device)


if __name__ == "__main__":
    sys.exit(main())
