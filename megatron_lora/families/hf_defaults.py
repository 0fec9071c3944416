"""What a field absent from config.json means: transformers 5.24's config class defaults.

transformers builds a model from a config.json by passing its fields to the family's config
class (`MixtralConfig`, `DeepseekV3Config`, ...), so a field the file leaves out takes the class's
default: a DeepSeek-V3 config without `routed_scaling_factor` scales by 2.5, without `n_group` /
`topk_group` routes in 8 groups keeping 4. Each table below is that class's `__init__` default
for every field the family's reader reads (families/fields.py applies them); None is the class's
"derive it" (num_key_value_heads: one per query head). `num_nextn_predict_layers` is the
attribute-map name of `num_mtp_layers` (default 1). tests/families/test_hf_defaults.py checks
each table against the installed class and each field's absence against what the class makes.
"""

from __future__ import annotations

_COMMON = dict(dtype=None, hidden_act="silu", rope_parameters=None, tie_word_embeddings=False)

MIXTRAL = dict(_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               head_dim=None, max_position_embeddings=131072, rms_norm_eps=1e-05,
               sliding_window=None, num_experts_per_tok=2, num_local_experts=8)

QWEN3_MOE = dict(_COMMON, vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                 num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4,
                 max_position_embeddings=32768, rms_norm_eps=1e-06, attention_bias=False,
                 use_sliding_window=False, decoder_sparse_step=1, moe_intermediate_size=768,
                 num_experts_per_tok=8, num_experts=128, norm_topk_prob=False,
                 mlp_only_layers=None)

QWEN2_MOE = dict(_COMMON, vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                 num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                 max_position_embeddings=32768, rms_norm_eps=1e-06, use_sliding_window=False,
                 decoder_sparse_step=1, moe_intermediate_size=1408,
                 shared_expert_intermediate_size=5632, num_experts_per_tok=4, num_experts=60,
                 norm_topk_prob=False, mlp_only_layers=None, qkv_bias=True)

OLMOE = dict(_COMMON, vocab_size=50304, hidden_size=2048, intermediate_size=2048,
             num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=None,
             max_position_embeddings=4096, rms_norm_eps=1e-05, attention_bias=False,
             clip_qkv=None, num_experts_per_tok=8, num_experts=64, norm_topk_prob=False)

GPT_OSS = dict(_COMMON, num_hidden_layers=36, num_local_experts=128, vocab_size=201088,
               hidden_size=2880, intermediate_size=2880, head_dim=64, num_attention_heads=64,
               num_key_value_heads=8, sliding_window=128, max_position_embeddings=131072,
               rms_norm_eps=1e-05, attention_dropout=0.0, num_experts_per_tok=4,
               swiglu_alpha=1.702, swiglu_limit=7.0, layer_types=None, attention_bias=True)

GLM4_MOE = dict(_COMMON, vocab_size=151552, hidden_size=4096, intermediate_size=10944,
                num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8,
                max_position_embeddings=131072, rms_norm_eps=1e-05, attention_bias=False,
                attention_dropout=0.0, moe_intermediate_size=1408, num_experts_per_tok=8,
                n_shared_experts=1, n_routed_experts=128, routed_scaling_factor=1.0, n_group=1,
                topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=False,
                num_nextn_predict_layers=1)

DEEPSEEK_V3 = dict(_COMMON, vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                   moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                   num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
                   routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                   qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
                   topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
                   norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-06,
                   rope_interleave=True, attention_bias=False, attention_dropout=0.0,
                   num_nextn_predict_layers=1)

DEEPSEEK_V2 = dict(_COMMON, vocab_size=102400, hidden_size=4096, intermediate_size=11008,
                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=None,
                   max_position_embeddings=2048, rms_norm_eps=1e-06, attention_bias=False,
                   attention_dropout=0.0, mlp_bias=False, first_k_dense_replace=0,
                   kv_lora_rank=512, q_lora_rank=1536, n_group=None, n_routed_experts=64,
                   n_shared_experts=2, qk_nope_head_dim=128, qk_rope_head_dim=64,
                   routed_scaling_factor=1.0, topk_group=None, topk_method="greedy",
                   norm_topk_prob=False, v_head_dim=128, num_experts_per_tok=None,
                   moe_intermediate_size=1407)
