"""Every torch tensor factory in the package names where its tensor lives.

A factory without `device` makes host memory: on a GPU that is a batch never moved, a count
all-reduced on the host, a parameter made beside a moved model (the first GPU run met all
three). The package says `device=runtime.device()` (or a tensor's device) for the rank's device
and `device="cpu"` for host memory on purpose. testing/device_check.py refuses such calls on the
paths the suite runs; this scan covers every line, run or not."""

import ast
import os

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "megatron_lora")
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "range", "rand",
             "randn", "randint", "randperm", "eye", "linspace", "logspace", "empty_strided"}


def _device_less_factories(source: str):
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value
        if isinstance(owner, ast.Name) and owner.id == "torch" and node.func.attr in FACTORIES:
            keywords = {k.arg for k in node.keywords}
            if "device" not in keywords and None not in keywords:  # **kwargs may carry it
                yield node.lineno, f"torch.{node.func.attr}"


def test_every_factory_in_the_package_names_its_device():
    found = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    found += [f"{os.path.relpath(path, PACKAGE)}:{line} {call}"
                              for line, call in _device_less_factories(f.read())]
    assert not found, "factories without device=:\n" + "\n".join(found)


def test_the_scan_sees_a_device_less_factory():
    bad = "import torch\ncounts = torch.tensor([1.0])\nok = torch.zeros(2, device='cpu')\n"
    assert list(_device_less_factories(bad)) == [(2, "torch.tensor")]
