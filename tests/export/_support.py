"""Shared pieces of the export tests: the LoRA config trained, a dataset within the tiny vocabulary,
the transformers + PEFT oracle, and megatron logits with an adapter at one rank."""

import json
import os
import subprocess
import sys

import torch

from megatron_lora.lora.model import LoraConfig
from megatron_lora.testing import compare

# Targets megatron_lora's apply_lora supports; a different rank and alpha on linear_proj so that
# rank_pattern / alpha_pattern are exported.
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "router"]
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, rank_pattern={"linear_proj": 2},
                  alpha_pattern={"linear_proj": 6}, seed=3)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dataset(vocab: int = 250, seed: int = 0):
    from megatron_lora.data import PackedDataset, Sample, pack_samples

    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(16):
        ids = torch.randint(0, vocab, (12,), generator=g).tolist()
        samples.append(Sample(ids, [1] * len(ids)))
    return PackedDataset(pack_samples(samples, 16, pad_id=0), seed=seed)


def hf_model(hf_dir: str):
    from transformers import MixtralForCausalLM

    m = MixtralForCausalLM.from_pretrained(hf_dir, attn_implementation="eager",
                                           experts_implementation="eager", dtype=torch.float32)
    return m.eval()


@torch.no_grad()
def peft_logits(hf_dir: str, adapter_dir: str, tokens: torch.Tensor, merged: bool = False,
                dtype: torch.dtype = torch.float32):
    """transformers + PEFT logits of the base with the adapter (or merge_and_unload'ed), the
    model evaluated in `dtype` (fp64: every weight upcast exactly from the fp32 files)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(hf_model(hf_dir), adapter_dir).eval().to(dtype)
    if merged:
        model = model.merge_and_unload()
    return model(tokens).logits.to(dtype)


@torch.no_grad()
def hf_logits(hf_dir: str, tokens: torch.Tensor, dtype: torch.dtype = torch.float32):
    """transformers' eager logits [B, S, V] of `hf_dir`, evaluated in `dtype`."""
    return hf_model(hf_dir).to(dtype)(tokens).logits.to(dtype)


def in_both(logits_fn, *args, **kwargs):
    """(fp32, fp64) evaluations of a reference: `logits_fn(*args, dtype=..., **kwargs)`."""
    return tuple(logits_fn(*args, dtype=d, **kwargs) for d in (torch.float32, torch.float64))


def assert_near_reference(ours: torch.Tensor, reference, what: str) -> float:
    """`ours` (fp32) within compare.reference_bound of the reference's fp32 evaluation:
    (K + 1) x the reference's own fp32 rounding max|ref32 - ref64| on these tokens (K = 10; why:
    compare's module docstring). `reference` is (ref32, ref64); returns the bound."""
    from tests.lora._bounds import judge  # also logs |diff| / bound to $MEGATRON_LORA_MARGINS

    ref32, ref64 = reference
    bound = compare.reference_bound(ref32, ref64)
    own = float((ref32.double() - ref64.double()).abs().max())
    failure = judge(ours, ref32, bound, f"{what} (compare.reference_bound: "
                    f"{compare.K_ORDERS + 1:g} x the reference's own fp32 rounding {own:.3e})")
    assert failure is None, failure
    return bound


def assert_moved(ours: torch.Tensor, before: torch.Tensor, bound: float, what: str,
                 times: float = 100.0) -> None:
    """The adapter (or whatever `what` names) moves `ours` away from `before` by more than
    `times` x `bound`: far beyond rounding, so a comparison within `bound` sees it act."""
    moved = float((ours.double() - before.double()).abs().max())
    assert moved > times * bound, (f"{what}: moves the logits by {moved:.3e}, not more than "
                                   f"{times:g} x the bound {bound:.3e}")


def torchrun(nproc: int, port=None) -> list:
    """The torchrun command line for `nproc` ranks: on `port`, or (None) `--standalone`, where
    torchrun picks a free port itself, so suites running side by side never meet on one."""
    where = ["--standalone"] if port is None else ["--master-port", str(port)]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *where]


def cli(*args, nproc: int = 1, port=None) -> subprocess.CompletedProcess:
    """Run `megatron-lora ARGS` (under torchrun when nproc > 1); returns the finished process."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    if nproc > 1:
        cmd = [*torchrun(nproc, port), "-m", "megatron_lora", *args]
    else:
        cmd = [sys.executable, "-m", "megatron_lora", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def write_tokens(path: str, tokens: torch.Tensor) -> str:
    with open(path, "w") as f:
        json.dump(tokens.tolist(), f)
    return path
