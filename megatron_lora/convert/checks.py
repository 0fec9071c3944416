"""Checks of a model's sizes before it is built: against a checkpoint, and against memory.

`check_before_build(info, layout, dtype, load=..., hf_config=...)` raises one ConversionError
listing

- every megatron tensor whose global shape, as config.json implies it, differs from the shape in
  the torch_dist checkpoint's `.metadata` (read from disk, no collective), naming the config
  fields that give the differing sizes; a wrong --hf-config otherwise surfaces as a
  CheckpointException traceback from dist_checkpointing.load after the model is built;
- a model whose parameters would not fit in this machine's memory (host, and the GPU's on CUDA),
  with the size in GiB, instead of trying to allocate it.

Every rank reads the same files and computes the same sizes (the largest pipeline stage, not its
own), so all ranks reach the same verdict before any collective.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import torch

from megatron_lora.convert.errors import ConversionError
from megatron_lora.families import VOCAB_MULTIPLE, ModelInfo
from megatron_lora.runtime import ParallelLayout

Dims = Tuple[Tuple[int, str], ...]  # per axis: (size, the config fields it comes from)

_ATTN, _MLP = "decoder.layers.self_attention.", "decoder.layers.mlp."
_MAX_LISTED = 4


def expected_shapes(info: ModelInfo) -> Dict[str, Dims]:
    """Global shape of every megatron tensor of `info`'s model (as mapping.mcore_tensors makes
    them), each axis labelled with the config.json fields that give it. O(1) in the model size,
    so absurd sizes cost nothing to check."""
    s, c = info.shape, info.hf_config
    h, f, L, E = s.hidden_size, s.ffn_hidden_size, s.num_layers, s.num_experts
    n, g, d = s.num_attention_heads, s.num_query_groups, info.head_dim
    vocab = (s.vocab_size, f"vocab_size={info.vocab_size} (padded to a multiple of "
                           f"{VOCAB_MULTIPLE}: {s.vocab_size})")
    fam = info.family
    hid, ffn = (h, f"hidden_size={h}"), (f, f"{fam.ffn_field}={f}")
    layers, experts = (L, f"num_hidden_layers={L}"), (E, f"{fam.experts_field}={E}")
    heads = f"num_attention_heads={n}, num_key_value_heads={c.get('num_key_value_heads', n)}"
    out = {
        "embedding.word_embeddings.weight": (vocab, hid),
        _ATTN + "linear_qkv.layer_norm_weight": (layers, hid),
        _ATTN + "linear_qkv.weight": (layers, ((n + 2 * g) * d, f"{heads}, head_dim={d}"), hid),
        _ATTN + "linear_proj.weight": (layers, hid, (n * d, f"num_attention_heads={n}, "
                                                           f"head_dim={d}")),
        _MLP + "linear_fc1.layer_norm_weight": (layers, hid),
        **(_qk_norm_shapes(info, layers, heads) if s.qk_layernorm else {}),
        _MLP + "router.weight": (layers, experts, hid),
        _MLP + "experts.experts.linear_fc1.weight": (layers, experts, (2 * f, ffn[1]), hid),
        _MLP + "experts.experts.linear_fc2.weight": (layers, experts, hid, ffn),
        "decoder.final_layernorm.weight": (hid,),
    }
    if s.moe_router_expert_bias:
        out[_MLP + "router.expert_bias"] = (layers, experts)
    if s.add_qkv_bias:
        out[_ATTN + "linear_qkv.bias"] = (layers, ((n + 2 * g) * d, f"{heads}, head_dim={d}"))
    fs = s.shared_expert_ffn_hidden_size
    if fs:
        shared = (fs, f"shared_expert_intermediate_size={fs}")
        out[_MLP + "shared_experts.linear_fc1.weight"] = (layers, (2 * fs, shared[1]), hid)
        out[_MLP + "shared_experts.linear_fc2.weight"] = (layers, hid, shared)
        if s.shared_expert_gate:
            out[_MLP + "shared_experts.gate_weight"] = (layers, (1, "the shared expert gate"), hid)
    fd = s.dense_ffn_hidden_size
    if fd:
        dense = (fd, f"{fam.dense_ffn_field}={fd}")
        out[_MLP + "linear_fc1.weight"] = (layers, (2 * fd, dense[1]), hid)
        out[_MLP + "linear_fc2.weight"] = (layers, hid, dense)
    if s.add_bias_linear:
        out[_ATTN + "linear_qkv.bias"] = (layers, ((n + 2 * g) * d, f"{heads}, head_dim={d}"))
        out[_ATTN + "linear_proj.bias"] = (layers, hid)
        out[_MLP + "router.bias"] = (layers, experts)
        out[_MLP + "experts.experts.linear_fc1.bias"] = (layers, experts, (2 * f, ffn[1]))
        out[_MLP + "experts.experts.linear_fc2.bias"] = (layers, experts, hid)
    if s.attention_sinks:
        out[_ATTN + "core_attention.softmax_offset"] = (layers, (n, f"num_attention_heads={n}"))
    if not s.tie_embeddings:
        out["output_layer.weight"] = (vocab, hid)
    if s.mla is not None:
        for key in [k for k in out if k.startswith(_ATTN)]:
            del out[key]
        out.update(_mla_shapes(info, layers, hid))
    return _per_layer(info, out) if s.per_layer_keys else out


def _mla_shapes(info: ModelInfo, layers, hid) -> Dict[str, Dims]:
    """The multi-latent attention tensors' shapes (convert/mla_tensors.py), labelled."""
    m, n = info.shape.mla, info.shape.num_attention_heads
    heads = f"num_attention_heads={n}"
    q, kv = (m.q_lora_rank, f"q_lora_rank={m.q_lora_rank}"), (m.kv_lora_rank,
                                                               f"kv_lora_rank={m.kv_lora_rank}")
    rope = f"qk_rope_head_dim={m.qk_pos_emb_head_dim}"
    q_rows = (n * m.q_head_dim, f"{heads} x (qk_nope_head_dim={m.qk_head_dim} + {rope})")
    out = {"decoder.layers.input_layernorm.weight": (layers, hid),
           _ATTN + "linear_kv_down_proj.weight": (
               layers, (m.kv_lora_rank + m.qk_pos_emb_head_dim, f"{kv[1]} + {rope}"), hid),
           _ATTN + "linear_kv_up_proj.layer_norm_weight": (layers, kv),
           _ATTN + "linear_kv_up_proj.weight": (
               layers, (n * (m.qk_head_dim + m.v_head_dim), f"{heads} x (qk_nope_head_dim="
                        f"{m.qk_head_dim} + v_head_dim={m.v_head_dim})"), kv),
           _ATTN + "linear_proj.weight": (
               layers, hid, (n * m.v_head_dim, f"{heads} x v_head_dim={m.v_head_dim}"))}
    if m.q_lora_rank is None:
        out[_ATTN + "linear_q_proj.weight"] = (layers, q_rows, hid)
    else:
        out.update({_ATTN + "linear_q_down_proj.weight": (layers, q, hid),
                    _ATTN + "linear_q_up_proj.layer_norm_weight": (layers, q),
                    _ATTN + "linear_q_up_proj.weight": (layers, q_rows, q)})
    return out


_DENSE_ONLY = (_MLP + "linear_fc1.weight", _MLP + "linear_fc2.weight")
_MOE_ONLY = (_MLP + "router.", _MLP + "experts.", _MLP + "shared_experts.")


def _per_layer(info: ModelInfo, stacked: Dict[str, Dims]) -> Dict[str, Dims]:
    """expected_shapes keyed as megatron keys a model with dense layers: per layer, without the
    layer axis; the router and experts on MoE layers, the dense MLP on dense ones."""
    from megatron_lora.convert.layer_keys import LAYERS, layer_key

    out = {}
    for key, dims in stacked.items():
        if not key.startswith(LAYERS):
            out[key] = dims
            continue
        for l in range(info.shape.num_layers):
            moe = info.shape.is_moe_layer(l)
            if key in _DENSE_ONLY and moe or key.startswith(_MOE_ONLY) and not moe:
                continue
            out[layer_key(key, l)] = dims[1:]
    return out


def _qk_norm_shapes(info: ModelInfo, layers, heads: str) -> Dict[str, Dims]:
    """The query/key norm weights: [d] per head, or the whole width ([n*d], [g*d])."""
    s, d = info.shape, info.head_dim
    qn, kn = s.qk_norm_widths()
    if not s.qk_norm_full_width:
        q = k = (d, f"head_dim={d}")
    else:
        q = (qn, f"num_attention_heads={s.num_attention_heads}, head_dim={d}")
        k = (kn, f"{heads}, head_dim={d}")
    return {_ATTN + "q_layernorm.weight": (layers, q), _ATTN + "k_layernorm.weight": (layers, k)}


def checkpoint_problems(info: ModelInfo, directory: str, config_name: str) -> List[str]:
    """Where the torch_dist checkpoint in `directory` disagrees with `info` (from config
    `config_name`, as the message should call it): tensors missing, or of another shape."""
    from megatron_lora.convert.dcp_read import TorchDistCheckpoint

    ckpt = TorchDistCheckpoint(directory)
    missing, differ, fields = [], [], {}
    for key, dims in expected_shapes(info).items():
        want = [size for size, _ in dims]
        try:
            got = list(ckpt.shape(key))
        except ConversionError:
            missing.append(key)
            continue
        if got != want:
            same_rank = len(got) == len(want)
            for (size, label), g in zip(dims, got if same_rank else [None] * len(dims)):
                if size != g:
                    fields[label] = None
            differ.append(f"{key} is {want} by the config, {got} in the checkpoint")
    parts = []
    if differ:
        simple = [f for f in fields if "," not in f] or list(fields)  # the likeliest culprit
        more = f"; {len(differ) - 2} more tensor(s) differ" if len(differ) > 2 else ""
        parts.append(f"{' and '.join(simple)} disagree{'s' if len(simple) == 1 else ''} with it "
                     f"({'; '.join(differ[:2])}{more})")
    if missing:
        tie = ", but tie_word_embeddings is false" if "output_layer.weight" in missing else ""
        parts.append(f"the checkpoint has no tensor {', '.join(missing[:_MAX_LISTED])}"
                     f"{' ...' if len(missing) > _MAX_LISTED else ''}{tie}")
    if info.shape.tie_embeddings and "output_layer.weight" in ckpt.tensors:
        parts.append("tie_word_embeddings is true, but the checkpoint has its own "
                     "output_layer.weight (an untied model)")
    if not parts:
        return []
    return [f"{config_name} does not describe the checkpoint {directory}: {'; '.join(parts)}"
            f"{info.defaults_note()}; pass the config.json of the model this checkpoint was "
            f"converted from"]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def parameter_bytes_per_rank(info: ModelInfo, layout: ParallelLayout, dtype: torch.dtype) -> int:
    """Bytes of model parameters the rank holding the largest pipeline stage allocates: its
    shards of [Vp/tp, h] embedding and output layer, of attention (TP) and of its E/ep experts
    (ETP), its whole norms and routers (with the fp32 expert bias, a buffer). Same on every
    rank."""
    s = info.shape
    elem = dtype.itemsize
    h, f, E = s.hidden_size, s.ffn_hidden_size, s.num_experts or 0
    n, g, d = s.num_attention_heads, s.num_query_groups, info.head_dim
    tp, etp = layout.tp, layout.expert_tp
    fs = s.shared_expert_ffn_hidden_size or 0
    qn, kn = s.qk_norm_widths()
    norms = (_ceil(qn + kn, tp) if s.qk_norm_full_width else qn + kn) if s.qk_layernorm else 0
    attention = (2 * h + norms + _ceil((n + 2 * g) * d * h + h * n * d, tp)
                 + _ceil((n + 2 * g) * d * s.add_qkv_bias, tp))
    if s.add_bias_linear:  # qkv (TP-sharded) and the output projection's (whole)
        attention += _ceil((n + 2 * g) * d, tp) * (not s.add_qkv_bias) + h
    if s.attention_sinks:
        attention += _ceil(n, tp)
    if s.mla is not None:
        attention = _mla_attention_elements(s, tp)
    moe_layer = (attention + E * h + _ceil(E, layout.ep) * _ceil(3 * f * h, etp)
                 + _ceil(3 * fs * h, tp) + h * s.shared_expert_gate)
    if s.moe_router_expert_bias:  # [E] fp32 whatever the dtype, counted in `dtype` elements
        moe_layer += _ceil(E * 4, elem)
    if s.add_bias_linear:  # the router's (whole) and each local expert's fc1 / fc2
        moe_layer += E + _ceil(E, layout.ep) * (_ceil(2 * f, etp) + h)
    per_stage = _ceil(s.num_layers, layout.pp)
    vocab = _ceil(s.vocab_size, tp) * h
    # Tied embeddings on more than one stage: the last stage holds its own copy of the output.
    output = vocab if (not s.tie_embeddings or layout.pp > 1) else 0
    first, last = vocab, h + output
    if s.moe_layer_pattern is None:
        layers = per_stage * moe_layer
        stage = layers + first + last if layout.pp == 1 else layers + max(first, last)
    else:  # stages differ by their mix of MoE and dense layers: the largest one
        dense_layer = attention + _ceil(3 * s.dense_ffn_hidden_size * h, tp)
        sizes = [moe_layer if moe else dense_layer for moe in s.moe_layer_pattern]
        starts = range(0, s.num_layers, per_stage)
        stage = max(sum(sizes[i:i + per_stage]) + first * (i == 0)
                    + last * (i + per_stage >= s.num_layers) for i in starts)
    return stage * elem


def _mla_attention_elements(s, tp: int) -> int:
    """Elements of an MLA layer's attention and its two layer norms on one TP rank: every linear
    split over TP (the down projections' rows, the up and output projections' heads), the latent
    norms and layer norms whole."""
    m = s.mla
    linears = m.linear_shapes(s.hidden_size, s.num_attention_heads).values()
    return (2 * s.hidden_size + (m.q_lora_rank or 0) + m.kv_lora_rank
            + sum(_ceil(n_in * n_out, tp) for n_in, n_out in linears))


def gib(n: int) -> str:
    """n bytes in GiB for a message (Python ints of any size)."""
    whole = n >> 30
    if whole < 10 ** 6:
        return f"{n / 2 ** 30:.1f} GiB"
    return f"about 10^{len(str(whole)) - 1} GiB"


def memory_problems(info: ModelInfo, layout: ParallelLayout, dtype: torch.dtype, *,
                    local_ranks: Optional[int] = None, host_bytes: Optional[int] = None,
                    device_bytes: Optional[int] = -1) -> List[str]:
    """The model does not fit: its parameters exceed this machine's memory (models are built on
    the CPU, so host memory holds every local rank's shard at once) or the GPU's.

    local_ranks: ranks on this machine (default LOCAL_WORLD_SIZE, else 1); host_bytes: default
    psutil's total memory; device_bytes: default this rank's GPU's total memory (None: no GPU)."""
    import psutil

    from megatron_lora import runtime

    per_rank = parameter_bytes_per_rank(info, layout, dtype)
    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if host_bytes is None:
        host_bytes = psutil.virtual_memory().total
    if device_bytes == -1:
        device_bytes = runtime.accelerator_memory_bytes()
    what = (f"the model's parameters ({info.config_fields()}) need {gib(per_rank)} per rank in "
            f"{str(dtype).replace('torch.', '')} at {layout.describe()}")
    fix = ("spread the model over more ranks (--tensor-model-parallel-size, "
           "--pipeline-model-parallel-size, --expert-model-parallel-size) or check these "
           "config.json sizes")
    problems = []
    if per_rank * local_ranks > host_bytes:
        on_host = (f" ({local_ranks} ranks here: {gib(per_rank * local_ranks)})"
                   if local_ranks > 1 else "")
        problems.append(f"{what}{on_host}, more than this machine's {gib(host_bytes)} of "
                        f"memory; {fix}")
    elif device_bytes is not None and per_rank > device_bytes:
        problems.append(f"{what}, more than the GPU's {gib(device_bytes)}; {fix}")
    return problems


def check_before_build(info: ModelInfo, layout: ParallelLayout, dtype: torch.dtype, *,
                       load: Optional[str] = None, hf_config: Optional[str] = None) -> None:
    """Raise ConversionError (every problem, one message) if the model `info` describes does not
    match the torch_dist checkpoint `load` (when given) or does not fit in memory. hf_config: the
    --hf-config the user passed (None: the checkpoint's own hf_config.json was used)."""
    problems = []
    if load:
        from megatron_lora.convert.hf_to_mcore import HF_CONFIG

        name = f"--hf-config {hf_config}" if hf_config else os.path.join(load, HF_CONFIG)
        problems += checkpoint_problems(info, load, name)
    problems += memory_problems(info, layout, dtype)
    if problems:
        raise ConversionError("; ".join(problems))
