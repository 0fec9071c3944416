"""megatron-core imported through megatron_lora skips TorchDynamo/Inductor and wandb at import
(runtime/lean_import.py); a kernel decorated while it imports still compiles, on its first call,
and wandb still imports afterwards."""

import subprocess
import sys

import torch

from megatron_lora.runtime import lean_import

PROBE = """
import sys
{first}
import megatron.core
from megatron.core import jit
print("inductor", "torch._inductor" in sys.modules, "wandb", "wandb" in sys.modules)
print("fuser", jit.jit_fuser.__name__)
try:
    import wandb
    print("wandb importable", hasattr(wandb, "init"))
except ImportError:
    print("wandb importable", "not installed")
"""


MOE_PROBE = """
import sys
import megatron_lora
import torch
from megatron.core.transformer.moe.router import TopKRouter
x = torch.ones(3, 4, dtype=torch.bool)
TopKRouter._apply_expert_bias(type("R", (), {"enable_expert_bias": False})(), x)
print("inductor", "torch._inductor" in sys.modules or "torch._dynamo.eval_frame" in sys.modules)
"""


def _probe(first: str) -> str:
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE.format(first=first)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_megatron_core_imports_lean_and_wandb_still_imports():
    out = _probe("import megatron_lora")
    assert "inductor False wandb False" in out and "fuser lazy" in out, out
    assert "wandb importable True" in out or "wandb importable not installed" in out, out


def test_without_megatron_lora_first_the_import_is_the_heavy_one():
    # the check above can fail: megatron-core imported directly pulls Inductor in at import
    out = _probe("")
    assert "inductor True" in out and "fuser compile" in out, out


def test_a_lazily_compiled_function_compiles_once_on_its_first_call(monkeypatch):
    compiled = []

    def fake_compile(model=None, **kwargs):  # stands for torch.compile: records, returns a twin
        compiled.append((model, kwargs))
        return lambda *a, **k: ("compiled", model(*a, **k))

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with lean_import._lazy_torch_compile():
        def double(x):
            return 2 * x

        lazy = torch.compile(double)
        factory = torch.compile(mode="max-autotune")  # with options: passed through as is
    assert torch.compile is fake_compile  # restored after the import
    assert compiled == [(None, {"mode": "max-autotune"})] and factory is not None
    assert lazy.__name__ == "double"
    assert lazy(3) == ("compiled", 6) and lazy(4) == ("compiled", 8)
    assert compiled[1:] == [(double, {})]  # compiled exactly once, at the first call


def test_without_cuda_a_kernel_runs_eagerly_and_never_compiles(monkeypatch):
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda model=None, **kw: compiled.append(model))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with lean_import._lazy_torch_compile():
        def double(x):
            return 2 * x

        lazy = torch.compile(double)
    assert lazy(3) == 6 and lazy(4) == 8 and compiled == []


def test_a_cpu_moe_forward_imports_no_inductor():
    # megatron's router calls a @jit_fuser function in every forward; on CPU it must not compile
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", MOE_PROBE], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "inductor False" in out.stdout, out.stdout
