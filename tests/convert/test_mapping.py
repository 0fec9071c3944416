"""The mapping table agrees with megatron-core's own sharded state dict, QKV slices read only
what they need and invert exactly, and a wrong QKV interleave is caught by the logits check."""

import pytest
import torch
from safetensors.torch import load_file

from megatron_lora.convert.mapping import QKV
from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank

TP1 = [pytest.param(ParallelLayout(), id="TP1")]


class DictReader:
    def __init__(self, tensors):
        self.tensors, self.reads = tensors, []

    def read(self, name, index=None):
        t = self.tensors[name] if index is None else self.tensors[name][index]
        self.reads.append((name, t.shape[0]))
        return t.clone()


@pytest.mark.parametrize("heads,groups,tp", [(4, 2, 2), (8, 2, 2), (8, 8, 4), (6, 3, 3), (4, 1, 1)])
def test_qkv_slices_match_the_full_interleave_and_split_inverts_it(heads, groups, tp):
    d, h = 3, 5
    g = torch.Generator().manual_seed(0)
    hf = {"q": torch.randn(heads * d, h, generator=g), "k": torch.randn(groups * d, h, generator=g),
          "v": torch.randn(groups * d, h, generator=g)}
    src = QKV("q", "k", "v", heads, groups, d, h)
    full = src.read(DictReader(hf), (slice(0, src.shape[0]), slice(0, h)))
    # megatron's layout: per group j, [its heads/groups query heads; k head j; v head j]
    qpg = heads // groups
    expected = torch.cat([torch.cat([hf["q"][j * qpg * d:(j + 1) * qpg * d], hf["k"][j * d:(j + 1) * d],
                                     hf["v"][j * d:(j + 1) * d]]) for j in range(groups)])
    assert torch.equal(full, expected)
    rows = src.shape[0] // tp
    for r in range(tp):  # a TP rank's rows, read without touching other ranks' HF rows
        reader = DictReader(hf)
        part = src.read(reader, (slice(r * rows, (r + 1) * rows), slice(1, 4)))
        assert torch.equal(part, full[r * rows:(r + 1) * rows, 1:4])
        assert sum(n for _, n in reader.reads) == rows
    assert all(torch.equal(src.split(full)[k], hf[k]) for k in hf)


@pytest.mark.parametrize("layout", TP1)
@multirank(world_size=1, timeout=240)
def test_table_matches_megatron_sharded_state_dict(layout, tiny_mixtral):
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    from megatron_lora.convert.mapping import extra_states, mcore_tensors
    from megatron_lora.families import read_hf_config
    from megatron_lora.models.build import build_model, model_config

    info = read_hf_config(tiny_mixtral["hf"])
    model = build_model(info, model_config(info, layout))
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    sharded, _, _ = load_preprocess(model.sharded_state_dict(metadata={"dp_cp_group": group}))
    tensors, objects = {}, set()
    for v in nested_values(sharded):
        if isinstance(v, ShardedTensor):
            tensors.setdefault(v.key, set()).add(tuple(v.global_shape))
        else:
            objects.add(v.unique_key)
    assert tensors == {t.key: {t.shape} for t in mcore_tensors(info)}
    assert objects == {o.unique_key for o in extra_states(info)}


@pytest.mark.parametrize("layout", TP1)
@multirank(world_size=1, timeout=240)
def test_a_wrong_qkv_interleave_gives_a_large_logits_diff(layout, tiny_mixtral):
    from megatron_lora.convert import mapping
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_hf
    from megatron_lora.convert.logits import forward_logits
    from megatron_lora.models.build import build_model, model_config

    def plain_concat(self, reader, index):  # [q; k; v] instead of per-group interleave
        return torch.cat([reader.read(n) for n in self.names])[index]

    ref = load_file(tiny_mixtral["reference"])
    info, hf, _ = open_hf(tiny_mixtral["hf"])
    correct_read = mapping.QKV.read
    mapping.QKV.read = plain_concat
    try:
        model = build_model(info, model_config(info, layout))
        load_hf(model, info, hf)
    finally:
        mapping.QKV.read = correct_read
    wrong = forward_logits(model, ref["tokens"], info.vocab_size)
    assert (wrong - ref["logits"]).abs().max().item() > 0.1
