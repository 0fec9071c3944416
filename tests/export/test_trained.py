"""An adapter trained at TP2xPP2xEP2+SP, exported, checked against transformers + PEFT: PEFT's
logits, PEFT's merge_and_unload, our merged HF export and our `logits --adapter` all give the
trained model's logits (fp32, within 11x the reference's own fp32 rounding, measured against
its fp64 evaluation: compare.reference_bound); import(export) is bit-identical; the export
does not depend on the layout the adapter was saved at."""

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from megatron_lora.convert.dcp_read import TorchDistCheckpoint
from megatron_lora.export.from_peft import import_peft
from megatron_lora.export.merged import export_merged_hf
from megatron_lora.export.to_peft import export_peft
from megatron_lora.runtime import ParallelLayout
from tests.export import _support as S
from tests.harness import multirank

def _tokens(paths):
    return torch.tensor(json.load(open(paths["tokens"])))


def test_export_matches_transformers_peft(trained, tmp_path):
    ours = load_file(trained["train_logits"])["logits"]
    out = str(tmp_path / "peft")
    config = export_peft(trained["run"], out, hf_config=trained["hf"])
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert config["rank_pattern"] == {"o_proj": 2} and config["alpha_pattern"] == {"o_proj": 6}
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w3", "w2", "gate"])
    with safe_open(os.path.join(out, "adapter_model.safetensors"), "pt") as f:
        for key in f.keys():
            if key.endswith("lora_B.weight"):
                assert f.get_tensor(key).abs().max() > 0, key  # trained: B moved off zero
    tokens = _tokens(trained)
    peft = S.in_both(S.peft_logits, trained["hf"], out, tokens)
    bound = S.assert_near_reference(ours, peft, "trained logits vs transformers + PEFT")
    S.assert_moved(ours, S.hf_logits(trained["hf"], tokens), bound, "the adapter")
    merged = S.in_both(S.peft_logits, trained["hf"], out, tokens, merged=True)
    S.assert_near_reference(ours, merged, "trained logits vs PEFT's merge_and_unload")


def test_logits_cli_with_adapter_at_another_layout(trained, tmp_path):
    ours = load_file(trained["train_logits"])["logits"]
    out = str(tmp_path / "logits.safetensors")
    proc = S.cli("logits", "--load", trained["mcore"], "--adapter", trained["run"],
                 "--tokens", trained["tokens"], "--out", out, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                 nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # two of our evaluations (TP2+SP here, TP2xPP2xEP2+SP in training): each within the bound
    # of transformers + PEFT's fp32 logits (compare.reference_bound), so both are checked there
    peft_dir = str(tmp_path / "peft")
    export_peft(trained["run"], peft_dir, hf_config=trained["hf"])
    peft = S.in_both(S.peft_logits, trained["hf"], peft_dir, _tokens(trained))
    S.assert_near_reference(ours, peft, "trained logits vs transformers + PEFT")
    S.assert_near_reference(load_file(out)["logits"], peft,
                            "logits --adapter at TP2+SP vs transformers + PEFT")


def test_merged_hf_export_loads_in_transformers(trained, tmp_path):
    ours = load_file(trained["train_logits"])["logits"]
    out = str(tmp_path / "merged")
    export_merged_hf(trained["mcore"], trained["run"], out, max_shard_bytes=200_000,
                     progress=False)
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    # bound: transformers' own fp32 rounding on the merged folder (compare.reference_bound);
    # the merge's one rounding per weight is of the size of one more matmul's, within K
    S.assert_near_reference(ours, S.in_both(S.hf_logits, out, _tokens(trained)),
                            "trained logits vs transformers on the merged export")


def _model_tensors(directory):
    ckpt = TorchDistCheckpoint(directory)
    out = {}
    for key in ckpt.tensors:
        if not key.startswith("optimizer."):
            shape = ckpt.shape(key)
            out[key] = ckpt.read(key, (0,) * len(shape), shape)
    return out


def test_import_of_export_is_bit_identical(trained, tmp_path):
    from megatron_lora.training.checkpoint import resolve

    export_peft(trained["run"], str(tmp_path / "peft"), hf_config=trained["hf"])
    report = import_peft(str(tmp_path / "peft"), str(tmp_path / "back"), hf_config=trained["hf"])
    assert report["ranks"] == {"linear_qkv": 4, "linear_proj": 2, "linear_fc1": 4, "linear_fc2": 4,
                               "router": 4}
    assert not report["notes"]  # shared A recognised: nothing stacked, padded or rescaled
    original, back = _model_tensors(resolve(trained["run"])), _model_tensors(str(tmp_path / "back"))
    assert sorted(original) == sorted(back)
    for key in original:
        assert original[key].dtype == back[key].dtype
        assert torch.equal(original[key].view(torch.uint8), back[key].view(torch.uint8)), key
    # and a second export of the imported checkpoint is the same file content
    export_peft(str(tmp_path / "back"), str(tmp_path / "peft2"), hf_config=trained["hf"])
    a = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "peft2" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@multirank(world_size=2, timeout=600)
def _reshard(hf, run, save, layout=ParallelLayout(ep=2)):
    """Load the adapter at EP2 (another layout) and save it again with megatron's own writer."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.export.adapter_ckpt import lora_config_from_dict
    from megatron_lora.lora.model import apply_lora
    from megatron_lora.models.build import build_model, model_config
    from megatron_lora.training.checkpoint import (
        load_adapter_weights,
        read_run_metadata,
        trainable_sharded_state_dict,
    )

    info, _, _ = open_hf(hf)
    model = build_model(info, model_config(info, layout))
    common = read_run_metadata(run)
    apply_lora(model, lora_config_from_dict(common["run_metadata"]["lora"]), verbose=False)
    load_adapter_weights([model], run)
    if dist.get_rank() == 0:
        os.makedirs(save)
    dist.barrier()
    state = trainable_sharded_state_dict([model])
    state["common"] = common
    dist_checkpointing.save(state, save)
    dist.barrier()


def test_export_does_not_depend_on_the_saved_layout(trained, tmp_path):
    resaved = str(tmp_path / "ep2")
    _reshard(hf=trained["hf"], run=trained["run"], save=resaved)
    export_peft(trained["run"], str(tmp_path / "a"), hf_config=trained["hf"])
    export_peft(resaved, str(tmp_path / "b"), hf_config=trained["hf"])
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        with open(tmp_path / "a" / name, "rb") as fa, open(tmp_path / "b" / name, "rb") as fb:
            assert fa.read() == fb.read(), name
