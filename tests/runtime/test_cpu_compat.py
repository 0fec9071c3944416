"""Each CPU fix in megatron_lora.runtime.cpu_compat, at the megatron-core call site it answers."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_lora.runtime import ParallelLayout, cpu_compat
from tests.harness import multirank

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU fixes are inactive with CUDA")


def test_install_is_a_no_op_when_cuda_is_usable():
    code = (
        "import torch\n"
        "from megatron_lora.runtime import cpu_compat\n"
        "cpu_compat.cuda_usable = lambda: True\n"
        "before = torch.cuda.current_device\n"
        "assert cpu_compat.install() == {}\n"
        "assert torch.cuda.current_device is before and cpu_compat.installed() == {}\n"
        "from torch.overrides import _get_current_function_mode_stack\n"
        "assert not _get_current_function_mode_stack()\n"
        "print('inactive')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "inactive" in out.stdout, out.stderr


@CPU_ONLY
@multirank(world_size=1)
def test_current_device_and_hard_coded_cuda_devices_map_to_cpu():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.utils import get_default_causal_mask

    assert cpu_compat.installed()["current_device"]
    with pytest.raises(Exception):
        cpu_compat.ORIGINALS["current_device"]()  # the real call asserts CUDA
    assert torch.cuda.current_device() == torch.device("cpu")
    # rotary_pos_embedding.py: inv_freq on torch.cuda.current_device()
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=False)
    assert rope.inv_freq.device.type == "cpu"
    # transformer/utils.py: torch.ones(sq, sq, device="cuda")
    mask = get_default_causal_mask(5)
    assert mask.device.type == "cpu" and torch.equal(mask, torch.triu(torch.ones(5, 5), 1).bool())
    # schedules.py total_num_tokens, tensor_parallel/data.py .cuda()
    assert torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(2).to("cuda").device.type == "cpu"
    assert torch.ones(2).to(torch.device("cuda", 0), torch.float64).dtype == torch.float64
    assert torch.tensor([0, 1], device="cuda", pin_memory=True).device.type == "cpu"


@CPU_ONLY
@multirank(world_size=1)
def test_streams_are_no_ops():
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    torch.cuda.current_stream().record_event(torch.cuda.Event())
    assert torch.cuda.current_stream() == stream  # dispatcher compares streams
    with torch.cuda.stream(stream):
        pass
    torch.cuda.synchronize()


@CPU_ONLY
@multirank(world_size=1)
def test_rng_tracker_forks_the_cpu_generator(layout=ParallelLayout()):
    from megatron_lora.runtime.rng import CpuRNGStatesTracker

    tracker = tensor_parallel.get_cuda_rng_tracker()
    assert isinstance(tracker, CpuRNGStatesTracker)
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the forked stream advanced


@CPU_ONLY
@multirank(world_size=1)
def test_router_gating_linear_runs_without_transformer_engine():
    from megatron.core.transformer.moe import moe_utils

    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    out = moe_utils.router_gating_linear(x, w, None, torch.float32)
    torch.testing.assert_close(out, x @ w.t())
    out.sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(6, 4).t() @ x.detach())


@CPU_ONLY
@multirank(world_size=2)
def test_alltoall_with_tensor_split_sizes():
    from megatron.core.transformer.moe import token_dispatcher

    rank = dist.get_rank()
    group = dist.group.WORLD
    # rank 0 sends 1 row to rank 0 and 2 rows to rank 1; rank 1 sends 3 rows to 0 and 1 row to 1.
    # On CPU the dispatcher hands its split sizes over as int64 tensors.
    send = {0: torch.tensor([1, 2]), 1: torch.tensor([3, 1])}[rank]
    recv = {0: torch.tensor([1, 3]), 1: torch.tensor([2, 1])}[rank]
    x = (torch.arange(int(send.sum()), dtype=torch.float32) + 10 * rank).unsqueeze(1).requires_grad_()
    with pytest.raises(Exception):
        cpu_compat.ORIGINALS["alltoall_splits"](group, x.detach(), recv, send)
    y = token_dispatcher.all_to_all(group, x, recv, send)
    expected = {0: [0.0, 10.0, 11.0, 12.0], 1: [1.0, 2.0, 13.0]}[rank]
    assert y.squeeze(1).tolist() == expected
    (y * (torch.arange(y.shape[0]).unsqueeze(1) + 1)).sum().backward()
    expected_grad = {0: [1.0, 1.0, 2.0], 1: [2.0, 3.0, 4.0, 3.0]}[rank]
    assert x.grad.squeeze(1).tolist() == expected_grad


@CPU_ONLY
@multirank(world_size=2)
def test_uneven_sequence_parallel_gather_and_its_backward(layout=ParallelLayout(tp=2, sp=True)):
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    rank = parallel_state.get_tensor_model_parallel_rank()
    group = parallel_state.get_tensor_model_parallel_group()
    splits = [3, 5]
    x = torch.full((splits[rank], 2), float(rank + 1), requires_grad=True)
    with pytest.raises(Exception):
        cpu_compat.ORIGINALS["uneven_gather"](x.detach(), group, splits)
    y = gather_from_sequence_parallel_region(x, group=group, output_split_sizes=splits)
    assert y.shape == (8, 2)
    torch.testing.assert_close(y[:3], torch.ones(3, 2))
    torch.testing.assert_close(y[3:], torch.full((5, 2), 2.0))
    weight = torch.arange(8, dtype=torch.float32).unsqueeze(1) * (rank + 1)
    (y * weight).sum().backward()
    # backward: reduce-scatter with the same splits; grads summed over both ranks' weights (x3).
    full = torch.arange(8, dtype=torch.float32).unsqueeze(1).expand(8, 2) * 3
    mine = full[:3] if rank == 0 else full[3:]
    torch.testing.assert_close(x.grad, mine)


@CPU_ONLY
@multirank(world_size=1)
def test_tensor_type_names_satisfy_megatron_optimizers():
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(1).type(torch.float64).dtype == torch.float64  # conversions are untouched
    # clip_grads.py asserts param.grad.type() == 'torch.cuda.FloatTensor'
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    # megatron scales by max_norm / (total_norm + 1e-6): 2 / (4 + 1e-6), within one fp32
    # rounding of the coefficient and one of the product (2 u relative)
    torch.testing.assert_close(p.grad, torch.full((4,), 2.0 / (4.0 + 1e-6)), rtol=2 * 2 ** -24,
                               atol=0)


@CPU_ONLY
@multirank(world_size=1)
def test_checkpoint_writer_results_queue_is_forked_not_spawned(tmp_path):
    import multiprocessing

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = None  # as in a process that has not saved yet
    before = {p.pid for p in multiprocessing.active_children()}
    w = torch.arange(12.0).reshape(3, 4)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", w)}, str(tmp_path))
    (manager,) = [p for p in multiprocessing.active_children() if p.pid not in before]
    assert type(manager._popen).__module__ == "multiprocessing.popen_fork", manager._popen
    # the forked Manager carries the writers' results: the checkpoint is whole and loads
    back = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4))},
                                   str(tmp_path))
    torch.testing.assert_close(back["w"], w)


ORPHAN = """
import os, sys
import megatron_lora
from megatron_lora.runtime import cpu_compat
cpu_compat.install()
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
name = "_get_write_results_queue" if hasattr(fa, "_get_write_results_queue") else "get_write_results_queue"
queue = getattr(fa, name)()
queue.put(1)
print(queue._manager._process.pid, flush=True)
os._exit(0)  # like a killed rank: no finalizer shuts the Manager down
"""


@CPU_ONLY
def test_the_forked_manager_exits_when_its_process_is_gone():
    import os
    import time

    out = subprocess.run([sys.executable, "-W", "ignore", "-c", ORPHAN], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, 9)
    raise AssertionError(f"the Manager process {pid} outlived its parent by 30 s")
