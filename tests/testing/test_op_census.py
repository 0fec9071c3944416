"""testing/op_census.py and the device check's reads of `torch.tensor([device scalars])`.

Each case runs in a fresh interpreter: DeviceCheck installs the CPU compatibility layer for the
process."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(script: str) -> dict:
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                                  PYTHONPATH=os.pathsep.join(
                                      [ROOT, os.environ.get("PYTHONPATH", "")])))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_list_of_device_scalars_is_read_element_by_element():
    """megatron's grad-norm fallback without apex makes torch.tensor([norm of each grad]): on a
    GPU each device scalar is copied to the host on its own (one synchronisation each). Three
    device scalars: three reads; host scalars and a device tensor given whole: none."""
    seen = _run(r"""
import json, torch
from megatron_lora.testing.device_check import RANK, DeviceCheck
with DeviceCheck() as check:
    norms = [torch.ones((), device=RANK) * k for k in range(3)]
    torch.tensor([norms])  # nested, as megatron's [[norm, ...]]
    after_device = len(check.reads)
    torch.tensor([torch.ones(()), 2.0])  # host scalars: no device read
    torch.as_tensor(torch.ones(4, device=RANK))  # not a list: a tensor stays where it is
print(json.dumps({"device": after_device, "all": len(check.reads),
                  "what": sorted({r.what for r in check.reads})}))
""")
    assert seen == {"device": 3, "all": 3, "what": ["tensor"]}


def test_kernel_bearing_ops():
    """Views, allocations and metadata reads launch no kernel; arithmetic, copies and fills do."""
    import torch

    from megatron_lora.testing.op_census import launches_kernel

    aten = torch.ops.aten
    for op in (aten.view.default, aten.t.default, aten.expand.default, aten.detach.default,
               aten.empty.memory_format, aten._local_scalar_dense.default,
               aten._unsafe_view.default, aten.transpose.int, aten.slice.Tensor):
        assert not launches_kernel(op), op
    for op in (aten.mm.default, aten.add.Tensor, aten.add_.Tensor, aten.copy_.default,
               aten.zero_.default, aten.clone.default, aten.linalg_vector_norm.default,
               aten._to_copy.default):
        assert launches_kernel(op), op


def test_census_counts_device_ops_of_steps_backward_included():
    """Inside a check, step 1 of a command: a device [4, 3] @ [3, 2] product, its sum and
    backward (the weight's gradient: mm; the sum's: expand is a view, so a fill or copy) are
    counted per op, host-only ops and the setup before the first step are not; trainable tensors
    are recorded once per command."""
    seen = _run(r"""
import json, torch
from megatron_lora.testing.device_check import RANK, DeviceCheck
from megatron_lora.testing.op_census import OpCensus
with DeviceCheck() as check, OpCensus(check) as census:
    w = torch.randn(3, 2, device=RANK, requires_grad=True)   # setup: step 0
    check.step += 1                                           # the first training step
    x = torch.randn(4, 3, device=RANK)
    (x @ w).sum().backward()
    torch.ones(5) + torch.ones(5)                             # host only
    census.count_trainable([torch.nn.Linear(2, 2)])
    census.count_trainable([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])  # once per command
report = census.report()
print(json.dumps({"ops": report["ops"], "trainable": report["trainable"]}))
""")
    (step,) = seen["ops"]
    assert (step["command"], step["step"]) == (0, 1)
    top = step["top"]
    # forward mm, backward mm for w's gradient (x's needs none); randn, sum
    assert top["aten.mm"] == 2 and top["aten.randn"] == 1 and top["aten.sum"] == 1, top
    assert "aten.t" not in top and "aten.expand" not in top and "aten.detach" not in top, top
    assert step["kernel_ops"] == sum(top.values()) and step["kernel_ops"] < 10, top
    assert seen["trainable"] == [{"command": 0, "total": 2, "per_moe_layer": []}]
