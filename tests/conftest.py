import os
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning, module="torch.jit")

import pytest

from megatron_lora.runtime import ParallelLayout
from tests.harness import close_worlds, multirank


def pytest_sessionfinish(session, exitstatus):
    close_worlds()


@multirank(world_size=1)
def _build_tiny_reference(directory, layout):
    from megatron_lora.models.gpt import tiny_mixtral_shape
    from megatron_lora.testing import parity

    parity.run_reference(directory, tiny_mixtral_shape())


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory):
    """Directory with the tiny Mixtral's weights, single-rank loss and embedding gradient."""
    directory = str(tmp_path_factory.mktemp("tiny_reference"))
    _build_tiny_reference(directory=directory, layout=ParallelLayout())
    assert os.path.exists(os.path.join(directory, "reference.safetensors"))
    return directory
