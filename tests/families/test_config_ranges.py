"""Integer fields are checked for sign and range, and a top-k beyond the experts is named as
such whatever the routing (with groups it got the group-scoring message)."""

import pytest

from megatron_lora.families import ModelConfigError, model_info
from tests.families.test_deepseek_v3 import CONFIG as DEEPSEEK
from tests.families.test_glm4_moe import CONFIG as GLM


@pytest.mark.parametrize("base", [DEEPSEEK, GLM], ids=["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("field", ["num_nextn_predict_layers", "first_k_dense_replace",
                                   "n_shared_experts"])
def test_a_negative_count_is_refused_naming_the_field(base, field):
    with pytest.raises(ModelConfigError) as err:
        model_info(dict(base, **{field: -1}), source="/m/config.json")
    want = ("must be a positive integer" if (base is GLM and field == "n_shared_experts")
            else "must be an integer >= 0")
    assert str(err.value).startswith(f"/m/config.json: field '{field}' {want}"), err.value
    assert str(err.value).endswith("got -1"), err.value


@pytest.mark.parametrize("base", [DEEPSEEK, GLM], ids=["deepseek_v3", "glm4_moe"])
def test_more_experts_per_token_than_experts_says_so_with_groups(base):
    experts = base["n_routed_experts"]
    cfg = dict(base, num_experts_per_tok=experts + 1, n_group=4, topk_group=2)
    with pytest.raises(ModelConfigError) as err:
        model_info(cfg, source="/m/config.json")
    assert str(err.value) == (f"/m/config.json: field 'num_experts_per_tok' must be <= "
                              f"num_experts ({experts}), got {experts + 1}")
