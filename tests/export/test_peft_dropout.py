"""An adapter trained with LoRA dropout on the experts and the router loads in transformers 5 +
PEFT: `export peft` writes lora_dropout 0 there (PEFT's ParamWrapper, which adapts the fused
expert and router parameters, refuses dropout), says so, and PEFT's logits equal the trained
model's (fp32, within 11x PEFT's own fp32 rounding: compare.reference_bound; every lora_B is
non-zero, so the adapter is in play)."""

import json
import os

import torch
from safetensors.torch import load_file, save_file

from megatron_lora.runtime import ParallelLayout
from tests.export import _support as S
from tests.harness import multirank

DROPOUT = 0.1
TARGETS = ["linear_qkv", "linear_fc1", "linear_fc2", "router"]


@multirank(world_size=1, timeout=600)
def _train_with_dropout(hf, save, out, tokens, layout=ParallelLayout()):
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_hf
    from megatron_lora.convert.logits import forward_logits
    from megatron_lora.lora.model import LoraConfig, apply_lora
    from megatron_lora.models.build import build_model, model_config
    from megatron_lora.training.loop import RunConfig, train
    from megatron_lora.training.optimizer import OptimConfig

    info, ckpt, _ = open_hf(hf)
    model = build_model(info, model_config(info, layout))
    load_hf(model, info, ckpt)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=DROPOUT, target_modules=TARGETS, seed=3)
    apply_lora(model, lora, verbose=False)
    run = RunConfig(micro_batch_size=1, global_batch_size=4, seq_length=16, train_iters=2,
                    save=save, log_interval=100)
    train([model], S.dataset(), run, OptimConfig(lr=2e-2, train_iters=2, clip_grad=1.0),
          layout_name=layout.describe(), run_metadata={"lora": lora.to_dict()})
    logits = forward_logits(model, torch.tensor(json.load(open(tokens))), info.vocab_size)
    save_file({"logits": logits.contiguous()}, out)


def test_export_of_a_dropout_run_loads_in_peft(tiny, tmp_path, capsys):
    from megatron_lora.cli import main

    run, ours_path = str(tmp_path / "run"), str(tmp_path / "ours.safetensors")
    _train_with_dropout(hf=tiny["hf"], save=run, out=ours_path, tokens=tiny["tokens"])
    out = str(tmp_path / "peft")
    assert main(["export", "peft", "--adapter", run, "--load-hf", tiny["hf"], "--save", out]) == 0
    err = capsys.readouterr().err
    tokens = torch.tensor(json.load(open(tiny["tokens"])))
    ours = load_file(ours_path)["logits"]
    peft = S.in_both(S.peft_logits, tiny["hf"], out, tokens)  # from_pretrained: must not raise
    assert f"note: lora_dropout={DROPOUT} (the training setting) written as 0" in err, err
    assert "ParamWrapper" in err and "gate, w1, w3, w2" in err
    config = json.load(open(os.path.join(out, "adapter_config.json")))
    assert config["lora_dropout"] == 0.0
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "gate",
                                                       "w1", "w3", "w2"])
    factors = load_file(os.path.join(out, "adapter_model.safetensors"))
    b = [v for k, v in factors.items() if k.endswith("lora_B.weight")]
    assert b and all(v.abs().max() > 0 for v in b)  # trained: every B moved off zero
    S.assert_near_reference(ours, peft, "logits of the dropout run vs transformers + PEFT")


def test_dropout_is_kept_where_peft_accepts_it():
    from megatron_lora.export.peft_config import inference_dropout
    from megatron_lora.families.mixtral import MIXTRAL

    wrapped = MIXTRAL.names.parameter_modules()
    assert wrapped == ("gate", "w1", "w3", "w2")
    assert inference_dropout(0.05, ["q_proj", "k_proj", "v_proj", "o_proj"], wrapped) == (0.05, [])
    assert inference_dropout(0.0, ["w1", "w3", "w2"], wrapped) == (0.0, [])
    value, notes = inference_dropout(0.05, ["q_proj", "w2"], wrapped)
    assert value == 0.0 and len(notes) == 1 and "w2" in notes[0] and "q_proj" not in notes[0]
