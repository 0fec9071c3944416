"""Reproducible RNG streams per parallel layout, on CPU and GPU.

megatron-core keeps named RNG states (data-parallel, tensor-parallel, expert-parallel) in
`tensor_parallel.random`'s tracker and forks into them around weight init and dropout. Its tracker
stores CUDA generator states; on CPU the same idea works with the CPU default generator, which is
what dropout and `torch.empty(...).uniform_()` draw from there.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.tensor_parallel import random as mrandom


class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
    """megatron's tracker with the CPU default generator in place of the CUDA one.

    Answers: tensor_parallel/random.py CudaRNGStatesTracker.add (torch.cuda.get_rng_state) and
    .fork (_get_cuda_rng_state / _set_cuda_rng_state), reached from model_parallel_cuda_manual_seed
    and every get_cuda_rng_tracker().fork().
    """

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        generator = torch.Generator()
        generator.manual_seed(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def install_cpu_rng_tracker() -> None:
    """Make megatron's get_cuda_rng_tracker() return a CpuRNGStatesTracker from now on."""
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def seed_everything(seed: int) -> None:
    """Make `seed` the run's seed (run_seed: the LoRA dropout keys, lora/dropout.py) and seed
    every generator with it (seed_generators)."""
    global _SEED
    _SEED = int(seed)
    seed_generators(seed)


def seed_generators(seed: int) -> None:
    """Seed the default generators and megatron's named streams for the current layout, leaving
    the run's seed as it is.

    Default (data-parallel) stream: `seed` on every rank. Tensor-parallel and expert streams are
    offset by megatron's rules from the rank's tp/ep/etp position, so a layout always draws the
    same numbers for the same seed. Once the model is built no training result depends on
    them: every random draw of a training step is keyed by the run's seed instead (LoRA dropout,
    lora/dropout.py; the data order, data/batches.py), so checkpoints carry no RNG state.
    """
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tracker = mrandom.get_cuda_rng_tracker()
    if isinstance(tracker, CpuRNGStatesTracker):
        # model_parallel_cuda_manual_seed calls initialize_rng_tracker(force_reset=False), which
        # keeps our tracker, then reset() + add() for each named stream.
        mrandom.model_parallel_cuda_manual_seed(seed)
    else:
        mrandom.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


_SEED = 1234  # seed_everything's (runtime.initialize's default)


def run_seed() -> int:
    """The seed of the last seed_everything (runtime.initialize), the same on every rank."""
    return _SEED
