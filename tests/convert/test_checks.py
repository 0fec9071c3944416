"""convert.checks: a config.json that does not describe the checkpoint, or a model too large for the
machine, is refused from the sizes and the checkpoint's metadata, before anything is built."""

import json
import math
import os

import pytest
import torch

from megatron_lora.convert.checks import (
    check_before_build,
    checkpoint_problems,
    expected_shapes,
    memory_problems,
    parameter_bytes_per_rank,
)
from megatron_lora.convert.errors import ConversionError
from megatron_lora.convert.mapping import mcore_tensors
from megatron_lora.families import model_info, read_hf_config
from megatron_lora.runtime import ParallelLayout
from tests.convert.tiny import TINY_CONFIG
from tests.harness import multirank


def _info(tiny_mixtral, **changes):
    with open(os.path.join(tiny_mixtral["hf"], "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    return model_info(cfg)


@pytest.mark.parametrize("tied", [False, True])
def test_expected_shapes_are_the_mapping_tables(tiny_mixtral, tied):
    info = _info(tiny_mixtral, tie_word_embeddings=tied)
    assert {k: tuple(n for n, _ in dims) for k, dims in expected_shapes(info).items()} == {
        t.key: t.shape for t in mcore_tensors(info)}


def test_matching_config_has_no_problems(tiny_mixtral):
    info = read_hf_config(tiny_mixtral["hf"])
    assert checkpoint_problems(info, tiny_mixtral["mcore"], "cfg") == []
    check_before_build(info, ParallelLayout(), torch.float32, load=tiny_mixtral["mcore"])


@pytest.mark.parametrize("change,fields,tensor", [
    (dict(hidden_size=128), "hidden_size=128 disagrees", "embedding.word_embeddings.weight is "
                                                         "[256, 128] by the config, [256, 64]"),
    (dict(intermediate_size=64), "intermediate_size=64 disagrees",
     "experts.experts.linear_fc1.weight is [4, 4, 128, 64] by the config, [4, 4, 192, 64]"),
    (dict(num_local_experts=2, num_experts_per_tok=1), "num_local_experts=2 disagrees",
     "mlp.router.weight is [4, 2, 64] by the config, [4, 4, 64]"),
    (dict(num_key_value_heads=4),
     "num_attention_heads=4, num_key_value_heads=4, head_dim=16 disagrees",
     "linear_qkv.weight is [4, 192, 64] by the config, [4, 128, 64]"),
    (dict(vocab_size=300), "vocab_size=300 (padded to a multiple of 128: 384) disagrees",
     "output_layer.weight is [384, 64] by the config, [256, 64]"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings is true, but the checkpoint has its own "
                                     "output_layer.weight", ""),
])
def test_mismatch_names_the_field_and_the_shapes(tiny_mixtral, change, fields, tensor):
    mcore = tiny_mixtral["mcore"]
    problems = checkpoint_problems(_info(tiny_mixtral, **change), mcore, "--hf-config x.json")
    assert len(problems) == 1
    assert problems[0].startswith(f"--hf-config x.json does not describe the checkpoint {mcore}: ")
    assert fields in problems[0] and tensor in problems[0], problems[0]


def test_bytes_per_rank_counts_every_parameter_once_at_tp1(tiny_mixtral):
    info = read_hf_config(tiny_mixtral["hf"])
    total = sum(math.prod(t.shape) for t in mcore_tensors(info))
    assert parameter_bytes_per_rank(info, ParallelLayout(), torch.float32) == 4 * total
    assert parameter_bytes_per_rank(info, ParallelLayout(), torch.bfloat16) == 2 * total
    # Sharding shrinks it: TP2 halves the vocabulary and attention, EP2 the experts.
    assert parameter_bytes_per_rank(info, ParallelLayout(tp=2, ep=2, sp=True),
                                    torch.float32) < 4 * total // 2 + 4 * 64 * 20


@multirank(world_size=2)
@pytest.mark.parametrize("layout", [ParallelLayout(tp=2, sp=True), ParallelLayout(pp=2),
                                    ParallelLayout(ep=2)])
def test_bytes_per_rank_is_what_the_largest_rank_allocates(tiny_mixtral, layout):
    """Build the model at the layout and count: the estimate is the largest rank's bytes."""
    import torch.distributed as dist

    from megatron_lora.models.build import build_model, model_config

    info = read_hf_config(tiny_mixtral["hf"])
    model = build_model(info, model_config(info, layout), use_te=False)
    mine = torch.tensor(sum(p.numel() * p.element_size() for p in model.parameters()))
    largest = mine.clone()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    assert parameter_bytes_per_rank(info, layout, torch.float32) == int(largest)


def test_model_larger_than_memory_is_refused_with_its_size(tiny_mixtral):
    info = _info(tiny_mixtral, vocab_size=10 ** 9)
    need = parameter_bytes_per_rank(info, ParallelLayout(), torch.float32)
    assert need > 2 * 10 ** 9 * 64 * 4  # embedding and output layer, fp32
    (msg,) = memory_problems(info, ParallelLayout(), torch.float32, local_ranks=1,
                             host_bytes=64 * 2 ** 30, device_bytes=None)
    assert msg.startswith("the model's parameters (vocab_size=1000000000, hidden_size=64,")
    assert f"need {need / 2 ** 30:.1f} GiB per rank in float32 at TP1, more than this " \
           "machine's 64.0 GiB of memory" in msg
    (msg,) = memory_problems(info, ParallelLayout(), torch.float32, local_ranks=1,
                             host_bytes=2 ** 50, device_bytes=80 * 2 ** 30)
    assert "more than the GPU's 80.0 GiB" in msg
    # Host memory holds every local rank's shard while the model is built on the CPU.
    small = read_hf_config(tiny_mixtral["hf"])
    per_rank = parameter_bytes_per_rank(small, ParallelLayout(), torch.float32)
    assert memory_problems(small, ParallelLayout(), torch.float32, local_ranks=2,
                           host_bytes=2 * per_rank, device_bytes=None) == []
    (msg,) = memory_problems(small, ParallelLayout(), torch.float32, local_ranks=3,
                             host_bytes=2 * per_rank, device_bytes=None)
    assert "(3 ranks here: " in msg


def test_check_before_build_reports_both(tiny_mixtral):
    info = _info(tiny_mixtral, vocab_size=10 ** 11)
    with pytest.raises(ConversionError) as err:
        check_before_build(info, ParallelLayout(), torch.float32, load=tiny_mixtral["mcore"],
                           hf_config="/x/config.json")
    msg = str(err.value)
    assert msg.startswith(f"--hf-config /x/config.json does not describe the checkpoint "
                          f"{tiny_mixtral['mcore']}: vocab_size=100000000000")
    assert "GiB per rank" in msg


@pytest.mark.parametrize("content,message", [
    (None, "file not found (not a megatron-core checkpoint)"),
    (b'{"sharded_backend": "torch_dist"\xff}', "not UTF-8 (byte 0xff at column 33)"),
    (b"[" * 100000, "JSON nested too deeply"),
    (b"[]", "sharded_backend=None, only 'torch_dist' is supported"),
])
def test_unreadable_checkpoint_metadata_json_is_named_once(tmp_path, content, message):
    path = tmp_path / "metadata.json"
    if content is not None:
        path.write_bytes(content)
    info = model_info(dict(TINY_CONFIG, model_type="mixtral"))
    with pytest.raises(ConversionError) as err:
        check_before_build(info, ParallelLayout(), torch.float32, load=str(tmp_path))
    assert str(err.value).startswith(f"{path}: {message}"), str(err.value)
    assert str(err.value).count(str(tmp_path)) == 1
