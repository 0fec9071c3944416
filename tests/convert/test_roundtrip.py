"""HF -> megatron -> HF is bit-identical tensor by tensor and loads in transformers; a checkpoint
megatron itself saved at TP2xEP2 exports to the same HF tensors."""

import os

import pytest
import torch
from safetensors.torch import load_file

from megatron_lora.runtime import ParallelLayout
from tests.convert.tiny import hf_logits
from tests.harness import multirank


def read_hf_tensors(directory):
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def assert_bit_identical(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def test_round_trip_is_bit_identical_and_loads_in_transformers(tiny_mixtral, tmp_path):
    from megatron_lora.convert.mcore_to_hf import mcore_to_hf

    out = str(tmp_path / "hf_out")
    mcore_to_hf(tiny_mixtral["mcore"], out, max_shard_bytes=300_000, progress=False)
    shards = [n for n in os.listdir(out) if n.endswith(".safetensors")]
    assert len(shards) > 1 and os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    assert os.path.isfile(os.path.join(out, "generation_config.json"))
    assert_bit_identical(read_hf_tensors(tiny_mixtral["hf"]), read_hf_tensors(out))
    ref = load_file(tiny_mixtral["reference"])
    torch.testing.assert_close(hf_logits(out, ref["tokens"]), ref["logits"], rtol=0, atol=0)


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2, ep=2, sp=True)], ids=["TP2xEP2+SP"])
@multirank(world_size=4, timeout=300)
def test_export_of_a_checkpoint_megatron_saved_at_tp2_ep2(layout, tiny_mixtral, tmp_path):
    import torch.distributed as dist

    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_hf
    from megatron_lora.convert.mcore_to_hf import mcore_to_hf
    from megatron_lora.models.build import build_model, model_config
    from megatron_lora.testing.reference import save_weights

    info, hf, _ = open_hf(tiny_mixtral["hf"])
    model = build_model(info, model_config(info, layout))
    load_hf(model, info, hf)
    saved = str(tmp_path / "megatron_saved")
    save_weights(model, saved)  # megatron's own torch_dist save, TP/EP-sharded chunks
    dist.barrier()
    if dist.get_rank() == 0:
        out = str(tmp_path / "hf_out")
        mcore_to_hf(saved, out, hf_config=os.path.join(tiny_mixtral["hf"], "config.json"),
                    progress=False)
        assert_bit_identical(read_hf_tensors(tiny_mixtral["hf"]), read_hf_tensors(out))
    dist.barrier()

