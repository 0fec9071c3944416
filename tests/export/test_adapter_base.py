"""An adapter records the base model it was trained on (run_metadata.base, lora/adapter_base.py)
and is refused on another family or other sizes, naming both, unless --allow-other-base says the
base is intended; one written before the record loads with a notice. Before, an attention-only
adapter made for a Mixtral loaded onto an OLMoE of the same attention shapes (`train --adapter`,
`logits --adapter`, `export peft` exited 0)."""

import json
import os

import pytest
import torch

from megatron_lora.convert.errors import ConversionError
from megatron_lora.export.adapter_ckpt import AdapterCheckpoint, write_adapter_checkpoint
from megatron_lora.export.table import KINDS, factor_shapes
from megatron_lora.families import model_info, read_hf_config
from megatron_lora.lora.model import LoraConfig
from tests.convert.tiny import TINY_CONFIG, make_tiny_mixtral

# An OLMoE whose attention has the tiny Mixtral's shapes (4 heads, 2 KV heads, 64 wide, 4
# layers; a vocabulary the byte tokenizer's 259 ids fit, for train)
OLMOE = dict(vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
             max_position_embeddings=128, rms_norm_eps=1e-5, architectures=["OlmoeForCausalLM"],
             model_type="olmoe")
MIXTRAL = dict(TINY_CONFIG, architectures=["MixtralForCausalLM"], model_type="mixtral")


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """{"mixtral": HF folder, "olmoe": HF folder, "adapter": an attention-only adapter made for
    the Mixtral, "data": a JSONL file}."""
    from transformers import AutoModelForCausalLM, OlmoeConfig

    root = tmp_path_factory.mktemp("bases")
    paths = {k: str(root / k) for k in ("mixtral", "olmoe", "adapter")}
    make_tiny_mixtral(paths["mixtral"])
    torch.manual_seed(0)
    cfg = {k: v for k, v in OLMOE.items() if k != "model_type"}
    AutoModelForCausalLM.from_config(OlmoeConfig(**cfg)).save_pretrained(paths["olmoe"])
    _adapter(read_hf_config(paths["mixtral"]), paths["adapter"])
    paths["data"] = str(root / "data.jsonl")
    with open(paths["data"], "w") as f:
        f.writelines(json.dumps({"text": f"sample {i} " * 4}) + "\n" for i in range(8))
    return paths


def _adapter(info, path):
    config = LoraConfig(r=2, lora_alpha=4.0, target_modules=["linear_qkv", "linear_proj"])
    kinds = {k.name: k for k in KINDS}

    def factors(site):
        a, b = factor_shapes(info, kinds[site.kind.name], config.r)
        return torch.full(a[-2:], 0.01), torch.full(b[-2:], 0.01)

    write_adapter_checkpoint(path, info, {k: 2 for k in config.target_modules}, factors, config,
                             torch.float32)
    return path


def test_the_adapter_is_refused_on_another_family_naming_both(bases):
    olmoe = read_hf_config(bases["olmoe"])
    with pytest.raises(ConversionError) as err:
        AdapterCheckpoint(bases["adapter"], olmoe)
    text = str(err.value)
    assert text.startswith(f"adapter {bases['adapter']} was trained on a mixtral (vocab_size=250, "
                           f"hidden_size=64, num_layers=4, "), text
    assert "base, not this olmoe (vocab_size=300, hidden_size=64" in text, text
    assert "(differing: family, vocab_size, ffn_hidden_size)" in text, text
    assert text.endswith("pass --allow-other-base if this base is intended"), text
    ckpt = AdapterCheckpoint(bases["adapter"], olmoe, allow_other_base=True)
    assert ckpt.base_note.endswith("applied anyway (--allow-other-base)")
    assert AdapterCheckpoint(bases["adapter"], read_hf_config(bases["mixtral"])).base_note is None


def test_the_adapter_is_refused_on_other_sizes_of_its_family(bases):
    wider_vocab = model_info(dict(MIXTRAL, vocab_size=300))  # the attention's shapes are the same
    with pytest.raises(ConversionError, match=r"\(differing: vocab_size\)"):
        AdapterCheckpoint(bases["adapter"], wider_vocab)


def test_an_adapter_without_the_record_loads_with_a_notice(bases, tmp_path, capsys):
    import shutil

    old = str(tmp_path / "old")
    shutil.copytree(bases["adapter"], old)
    common = torch.load(os.path.join(old, "common.pt"), weights_only=True)
    del common["common"]["run_metadata"]["base"]
    torch.save(common, os.path.join(old, "common.pt"))
    ckpt = AdapterCheckpoint(old, read_hf_config(bases["olmoe"]))  # only shapes: as before
    assert "does not record the base model it was trained on" in ckpt.base_note
    assert f"notice: adapter {old} does not record" in capsys.readouterr().err


def test_export_peft_and_logits_exit_2_and_allow_other_base_exports(bases, tmp_path, capsys):
    from megatron_lora.cli import main

    out = str(tmp_path / "peft")
    args = ["export", "peft", "--adapter", bases["adapter"], "--load-hf", bases["olmoe"],
            "--save", out]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "base, not this olmoe" in err and "Traceback" not in err and not os.path.exists(out)
    assert main(args + ["--allow-other-base"]) == 0
    assert "applied anyway (--allow-other-base)" in capsys.readouterr().err
    tokens = str(tmp_path / "tokens.json")
    with open(tokens, "w") as f:
        json.dump([[1, 2, 3, 4]], f)
    assert main(["logits", "--load-hf", bases["olmoe"], "--adapter", bases["adapter"],
                 "--tokens", tokens, "--out", str(tmp_path / "l.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "base, not this olmoe" in err and "--allow-other-base" in err, err


def test_train_adapter_is_refused_on_another_base(bases):
    from megatron_lora.cli import build_parser
    from megatron_lora.cli.train_run import TrainSetupError, _setup_checks
    from megatron_lora.runtime import ParallelLayout

    argv = ["train", "--load-hf", bases["olmoe"], "--data-path", bases["data"], "--tokenizer",
            "byte", "--seq-length", "16", "--global-batch-size", "2", "--train-iters", "1",
            "--adapter", bases["adapter"]]
    with pytest.raises((TrainSetupError, ConversionError), match="base, not this olmoe"):
        _setup_checks(build_parser().parse_args(argv), ParallelLayout(), 1)
    *_, initial = _setup_checks(build_parser().parse_args(argv + ["--allow-other-base"]),
                                ParallelLayout(), 1)
    assert initial.directory == bases["adapter"]


def test_a_resume_accepts_a_checkpoint_without_the_record_and_refuses_another_base(bases):
    from megatron_lora.lora.adapter_base import base_record
    from megatron_lora.training.resume import metadata_differences

    mixtral, olmoe = (base_record(read_hf_config(bases[k])) for k in ("mixtral", "olmoe"))
    assert metadata_differences({"lora": {"r": 2}}, {"lora": {"r": 2}, "base": mixtral}) == ([], [])
    refused, _ = metadata_differences({"base": mixtral}, {"base": olmoe})
    assert [p for p, *_ in refused] == ["base.family", "base.ffn_hidden_size", "base.model_type",
                                        "base.vocab_size"]
