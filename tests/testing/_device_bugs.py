"""The four placement bugs the first GPU run met, put back one at a time (`device_check --setup
tests.testing._device_bugs:NAME`). Each is the code as it was, reached from where it ran."""

import torch
import torch.distributed as dist


def host_count_all_reduce():
    """training/step.py counted the global batch's tokens with an all-reduce of a host tensor
    (NCCL: 'No backend type associated with device type cpu')."""
    from megatron.core import parallel_state

    def _global_count(local_mask):
        counts = torch.tensor([float(local_mask.sum())])
        dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
        return float(counts.item())

    from megatron_lora.training import loop

    original = loop.forward_backward

    def forward_backward(model_chunks, tokens, labels, loss_mask=None, *args, **kwargs):
        _global_count(loss_mask)
        return original(model_chunks, tokens, labels, loss_mask, *args, **kwargs)

    loop.forward_backward = forward_backward


def host_loss_pair():
    """training/step.py summed the device losses into a host pair ('Expected all tensors to be
    on the same device ... cuda:0 and cpu')."""
    from megatron.core import parallel_state

    from megatron_lora.training import step

    def _global_mean(reduced):
        pair = torch.zeros(2, dtype=torch.float32)
        if parallel_state.is_pipeline_last_stage():
            for item in reduced:
                pair += item["loss_sum_and_count"].float()
            dist.all_reduce(pair, group=parallel_state.get_data_parallel_group())
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(pair, group=parallel_state.get_pipeline_model_parallel_group())
        return pair[0] / pair[1]

    step._global_mean = _global_mean


def batch_left_on_host():
    """The token batches were never moved to the rank's device ('index is on cpu, different
    from other tensors on cuda:0', in the embedding)."""
    from megatron_lora.training import loop

    loop._on_device = lambda batch: batch


def prefix_on_host():
    """Prefix-tuning parameters were made on the host (megatron DDP: 'Wrapped parameters must
    be one of torch.cuda.FloatTensor ...')."""
    from megatron_lora.lora import prefix

    class Host:
        @staticmethod
        def device():
            return torch.device("cpu")

    prefix.runtime = Host
