"""megatron-core imported through megatron_lora skips TorchDynamo/Inductor and wandb at import,
and the kernels and W&B still work when used (runtime/lean_import.py)."""

import subprocess
import sys

PROBE = """
import sys
{first}
import megatron.core
from megatron.core import jit
print("inductor", "torch._inductor" in sys.modules, "wandb", "wandb" in sys.modules)
import torch
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu
x, b = torch.randn(4, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
y = x + b
a, g = y.chunk(2, dim=-1)
print("swiglu right", torch.allclose(bias_swiglu(x, b), torch.nn.functional.silu(a) * g, rtol=1e-12, atol=0))
try:
    import wandb
    print("wandb importable", hasattr(wandb, "init"))
except ImportError:
    print("wandb importable", "not installed")
"""


def _probe(first: str) -> str:
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE.format(first=first)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_megatron_core_imports_lean_and_its_kernels_and_wandb_still_work():
    out = _probe("import megatron_lora")
    assert "inductor False wandb False" in out, out
    assert "swiglu right True" in out, out  # the lazily compiled kernel ran and is right
    assert "wandb importable True" in out or "wandb importable not installed" in out, out


def test_without_megatron_lora_first_the_import_is_the_heavy_one():
    # the check above can fail: megatron-core imported directly pulls Inductor in at import
    out = _probe("")
    assert "inductor True" in out, out
