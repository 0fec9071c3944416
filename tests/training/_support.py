"""A tiny training setup shared by the training tests: model, data, configs."""

import torch

from megatron_lora.data import PackedDataset, Sample, pack_samples
from megatron_lora.models.gpt import build_gpt_model, tiny_moe_shape, transformer_config
from megatron_lora.testing.reference import load_weights
from megatron_lora.training.loop import RunConfig
from megatron_lora.training.optimizer import OptimConfig

SHAPE = tiny_moe_shape(vocab_size=384)
SEQ = 32
# Trainable: a TP-sharded linear, an expert linear (expert-DP reduction) and the norms (replicated;
# summed over TP under SP by finalize_model_grads): every gradient path of the loop.
TRAINABLE = ("linear_proj", "linear_fc2", "input_layernorm")
# The terms a trained tensor's gradient accumulates along its longest chain (fp32): the 4 x SEQ
# tokens of a step, the vocabulary's softmax, and per layer the hidden columns, the widest
# projection (the FFN) and SEQ keys: 1280
CHAIN = 4 * SEQ + SHAPE.vocab_size + SHAPE.num_layers * (SHAPE.hidden_size +
                                                         SHAPE.ffn_hidden_size + SEQ)


def dataset(seed: int = 5, samples: int = 48) -> PackedDataset:
    """`samples` short texts, one per packed sequence of SEQ tokens."""
    rows = []
    for i in range(samples):
        text = f"{i} squared is {i * i}."
        ids = [256] + list(text.encode()) + [257]
        rows.append(Sample(ids, [1] * len(ids)))
    return PackedDataset(pack_samples(rows, SEQ, pad_id=258), seed=seed)


def model(layout, weights_dir=None):
    m = build_gpt_model(SHAPE, transformer_config(SHAPE, layout))
    if weights_dir is not None:
        load_weights(m, weights_dir)
    for name, p in m.named_parameters():
        p.requires_grad = any(t in name for t in TRAINABLE)
    return m


def run_config(save=None, iters=5, **kw) -> RunConfig:
    return RunConfig(micro_batch_size=1, global_batch_size=4, seq_length=SEQ, train_iters=iters,
                     save=save, log_interval=100, **kw)


def optim(iters=5) -> OptimConfig:
    return OptimConfig(lr=3e-3, lr_warmup_iters=1, train_iters=iters, clip_grad=1.0)


def per_expert(adapters) -> dict:
    """apply_lora's {name: adapter} with each stacked expert adapter (ExpertLora) replaced by its
    local experts' views, keyed by their global names (`...experts.5.linear_fc1`)."""
    from megatron_lora.lora.expert_lora import ExpertLora

    out = {}
    for name, ad in adapters.items():
        if isinstance(ad, ExpertLora):
            out.update((view.global_name, view) for view in ad.experts())
        else:
            out[name] = ad
    return out


def factor_grad(adapter, name: str):
    """The gradient of an adapter factor (megatron DDP's main_grad where there is one, else
    .grad); for an expert view its slice of the stacked gradient."""
    if callable(getattr(adapter, "grad", None)):
        return adapter.grad(name)
    p = getattr(adapter, name)
    return p.main_grad if getattr(p, "main_grad", None) is not None else p.grad


def global_adapters(adapters) -> dict:
    """{global name.A/B: the adapter's global factor} (gathered over its TP / expert-TP group;
    each rank has the adapters of its own pipeline stage and experts)."""
    import torch.distributed as dist

    from megatron_lora.lora import global_factors
    from megatron_lora.lora.gather import unstride
    from megatron_lora.lora.parallel import COLUMN

    from megatron_lora.lora.prefix import PrefixAttention, PrefixEncoder
    from megatron_lora.lora.trainable_tokens import TrainableTokensEmbedding, TrainableTokensOutput

    out = {}
    for name, ad in per_expert(adapters).items():
        if isinstance(ad, (PrefixAttention, PrefixEncoder)):
            out.update(_global_prefix(name, ad))
            continue
        if isinstance(ad, (TrainableTokensEmbedding, TrainableTokensOutput)):
            out[f"{name}.rows"] = ad.trainable_tokens_delta.detach().clone()  # replicated
            continue
        out[f"{name}.A"], out[f"{name}.B"] = global_factors(ad)
        m = getattr(ad, "magnitude", None)
        if m is not None:  # DoRA: [out] sharded like B's rows (column base), else replicated
            g = ad.geometry
            m = m.detach()
            if g.mode == COLUMN and g.tp_size > 1:
                parts = [torch.empty_like(m) for _ in range(g.tp_size)]
                dist.all_gather(parts, m.contiguous(), group=g.tp_group)
                m = unstride(parts, 0, g.stride)
            out[f"{name}.m"] = m.clone()
    return out


def _global_prefix(name, module) -> dict:
    """{global name.param: global tensor} of a prefix module: per-layer parameters gathered over
    TP on their query-group dim, the shared encoder's as held (replicated)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    out = {}
    for pname, p in module.named_parameters(recurse=False):
        t = p.detach().contiguous()
        if getattr(p, "tensor_model_parallel", False) and group.size() > 1:
            parts = [torch.empty_like(t) for _ in range(group.size())]
            dist.all_gather(parts, t, group=group)
            t = torch.cat(parts, dim=p.partition_dim)
        out[f"{name}.{pname}"] = t.clone()
    return out


def assert_trained_like(final: dict, reference: dict, lr: float, steps: int, what: str) -> None:
    """Tensors {name: tensor} trained by Adam (`steps` steps, peak learning rate `lr`; warm-up
    and decay only lower it) at another layout against the one-rank run's: every element within
    Adam's bound (2 x lr x |m/sqrt(v)| per step, a gradient that cancels to within its rounding
    may go either way), all but rare single elements per tensor within the bound for
    gradients that do not nearly cancel (CHAIN x u x 100 relative rounding, as much on Adam's
    ratio); see megatron_lora/testing/compare.py. A wrong gradient, reduction or shard moves
    most elements of a tensor by whole steps."""
    from megatron_lora.testing import compare

    lrs = [lr] * steps
    compare.assert_adam_trained_close(final, {n: reference[n] for n in final}, lrs,
                                      compare.adam_tight_bound(lrs, CHAIN), what)


def many_tensors_module(count: int, shape=(4, 8)):
    """A megatron module of `count` trainable fp32 tensors of `shape` on the rank's device,
    seeded by `count`; every other one an expert parameter (`allreduce = False`), as expert LoRA
    makes them. For optimizer tests at many trainable tensors."""
    from megatron.core.transformer.module import MegatronModule

    from megatron_lora import runtime
    from megatron_lora.runtime import ParallelLayout

    class Tensors(MegatronModule):
        def __init__(self):
            super().__init__(transformer_config(SHAPE, ParallelLayout()))
            g = torch.Generator().manual_seed(count)
            self.weights = torch.nn.ParameterList(
                torch.nn.Parameter(torch.randn(*shape, generator=g).to(runtime.device()))
                for _ in range(count))
            for k, p in enumerate(self.weights):
                if k % 2:
                    p.allreduce = False  # megatron's mark of an expert parameter

    return Tensors()
