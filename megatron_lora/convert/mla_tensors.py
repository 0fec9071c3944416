"""The conversion mapping of one multi-latent attention layer (ModelShape.mla; DeepSeek-V2/V3).

megatron keys (stacked: a leading layer axis; per layer for models with dense layers, as every
DeepSeek model has) and their HF sources, n heads, r = qk_pos_emb_head_dim (models/mla.py has
the module-level table and the rope layouts):

| megatron key (decoder.layers.)                          | HF (model.layers.l.)                  |
|---------------------------------------------------------|---------------------------------------|
| input_layernorm.weight [h]                              | input_layernorm.weight                |
| self_attention.linear_q_down_proj.weight [q_lora, h]    | self_attn.q_a_proj.weight             |
| self_attention.linear_q_up_proj.layer_norm_weight [q_lora] | self_attn.q_a_layernorm.weight     |
| self_attention.linear_q_up_proj.weight [n (nope + r), q_lora] | self_attn.q_b_proj.weight (rope rows) |
| self_attention.linear_q_proj.weight [n (nope + r), h] (no q_lora_rank) | self_attn.q_proj.weight (rope rows) |
| self_attention.linear_kv_down_proj.weight [kv_lora + r, h] | self_attn.kv_a_proj_with_mqa.weight (rope rows) |
| self_attention.linear_kv_up_proj.layer_norm_weight [kv_lora] | self_attn.kv_a_layernorm.weight  |
| self_attention.linear_kv_up_proj.weight [n (nope + v), kv_lora] | self_attn.kv_b_proj.weight    |
| self_attention.linear_proj.weight [h, n v]              | self_attn.o_proj.weight               |

The latent norms sit under the up projections' keys, where Transformer Engine's spec keeps them
(models/specs.py MLA_KEYS_MAP). "rope rows": with rope_interleave false, the last r rows of each
head (of the one kv group) are reordered (RopeRows); with true (DeepSeek's checkpoints) they are
copied as they are.
"""

from __future__ import annotations

from typing import List, Tuple

from megatron_lora.convert.sources import Direct, RopeRows

ATTN = "decoder.layers.self_attention."
INPUT_NORM = "decoder.layers.input_layernorm.weight"


def attention_tensors(info, p: str) -> List[Tuple[str, object]]:
    """(stacked megatron key, source) of one MLA layer's attention, input norm first; p: the
    layer's HF prefix ("" gives the sources' shapes)."""
    from megatron_lora.models.mla import rope_row_order

    s, names = info.shape, info.family.names
    m, h, n = s.mla, s.hidden_size, s.num_attention_heads
    r = m.qk_pos_emb_head_dim
    orders = (rope_row_order(m, True), rope_row_order(m, False))

    def rope(name: str, shape, groups: int, lead: int):
        if m.rope_interleaved:
            return Direct(name, shape)
        return RopeRows(name, shape, groups, lead, *orders)

    out = [(INPUT_NORM, Direct(p + names.input_norm, (h,)))]
    if m.q_lora_rank is None:
        out.append((ATTN + "linear_q_proj.weight",
                    rope(p + names.q, (n * m.q_head_dim, h), n, m.qk_head_dim)))
    else:
        q = m.q_lora_rank
        out += [(ATTN + "linear_q_down_proj.weight", Direct(p + names.q_a, (q, h))),
                (ATTN + "linear_q_up_proj.layer_norm_weight", Direct(p + names.q_a_norm, (q,))),
                (ATTN + "linear_q_up_proj.weight",
                 rope(p + names.q_b, (n * m.q_head_dim, q), n, m.qk_head_dim))]
    kv = m.kv_lora_rank
    out += [(ATTN + "linear_kv_down_proj.weight", rope(p + names.kv_a, (kv + r, h), 1, kv)),
            (ATTN + "linear_kv_up_proj.layer_norm_weight", Direct(p + names.kv_a_norm, (kv,))),
            (ATTN + "linear_kv_up_proj.weight",
             Direct(p + names.kv_b, (n * (m.qk_head_dim + m.v_head_dim), kv))),
            (ATTN + "linear_proj.weight", Direct(p + names.o, (h, n * m.v_head_dim)))]
    return out


def linear_names(info) -> Tuple[str, ...]:
    """The attention linears of an MLA layer (their `_extra_state` objects), under
    `self_attention.`."""
    q = ("linear_q_proj",) if info.shape.mla.q_lora_rank is None else (
        "linear_q_down_proj", "linear_q_up_proj")
    return ("linear_proj",) + q + ("linear_kv_down_proj", "linear_kv_up_proj")
