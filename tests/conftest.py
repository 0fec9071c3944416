import importlib.util
import os
import shutil
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning, module="torch.jit")

import pytest

from megatron_lora.runtime import ParallelLayout
from tests.harness import close_worlds, multirank


def pytest_sessionfinish(session, exitstatus):
    close_worlds()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "versioned: exercises a difference between megatron-core releases "
        "(tests/runtime/versioned.py); `make test TESTS=versioned` runs only these")


def pytest_collection_modifyitems(config, items):
    """Mark the tests listed in tests/runtime/versioned.py `versioned`."""
    from tests.runtime.versioned import versioned_ids

    listed = versioned_ids()
    for item in items:
        file, _, rest = item.nodeid.partition("::")
        if file in listed or f"{file}::{rest.split('[')[0]}" in listed:
            item.add_marker(pytest.mark.versioned)


@multirank(world_size=1)
def _build_tiny_reference(directory, layout):
    from megatron_lora.models.gpt import tiny_moe_shape
    from megatron_lora.testing import parity

    parity.run_reference(directory, tiny_moe_shape())


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory):
    """Directory with the tiny Mixtral's weights, single-rank loss and embedding gradient."""
    directory = str(tmp_path_factory.mktemp("tiny_reference"))
    _build_tiny_reference(directory=directory, layout=ParallelLayout())
    assert os.path.exists(os.path.join(directory, "reference.safetensors"))
    return directory


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _make_tiny_example_module():
    spec = importlib.util.spec_from_file_location(
        "make_tiny_example", os.path.join(ROOT, "tools", "make_tiny_example.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_example_source(tmp_path_factory):
    """tools/make_tiny_example.py's HF Mixtral (what `make demo` trains), made once per session in
    this process (its own seed; the session's CPU torch RNG is left as it was) and converted once to
    torch_dist. Read-only: tests get copies through `tiny_example`."""
    import torch

    from megatron_lora.convert.hf_to_mcore import hf_to_mcore

    root = tmp_path_factory.mktemp("tiny_example_source")
    with torch.random.fork_rng(devices=[]):
        _make_tiny_example_module().make_model(str(root / "hf"))
    hf_to_mcore(str(root / "hf"), str(root / "mcore"), progress=False)
    return str(root)


@pytest.fixture(scope="session")
def tiny_example(tiny_example_source):
    """tiny_example(out, samples, mcore=False): write into folder `out` what
    `python tools/make_tiny_example.py --out OUT --samples SAMPLES` writes (a copy of the session's
    tiny HF Mixtral in OUT/hf, SAMPLES lines of OUT/data.jsonl) and, with mcore=True, a copy of
    its torch_dist conversion in OUT/mcore. Returns `out` as a string."""
    make_data = _make_tiny_example_module().make_data

    def make(out, samples, mcore=False):
        out = str(out)
        os.makedirs(out, exist_ok=True)
        shutil.copytree(os.path.join(tiny_example_source, "hf"), os.path.join(out, "hf"))
        if mcore:
            shutil.copytree(os.path.join(tiny_example_source, "mcore"), os.path.join(out, "mcore"))
        make_data(os.path.join(out, "data.jsonl"), samples)
        return out

    return make
