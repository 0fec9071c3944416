"""DoRA adapters trained 3 steps at PP2xEP2 (dropout 0.1), exported, judged by transformers + PEFT:
an attention DoRA adapter exports to PEFT (`use_dora: true`, `lora_magnitude_vector` per module)
whose logits, and PEFT's merge_and_unload, and our merged HF export, equal the trained model's
(fp32, within 11x the reference's own fp32 rounding: compare.reference_bound), and `import
peft` of it gives back the trained checkpoint's tensors bit for bit; the trained magnitudes matter (resetting them to the row norms moves
PEFT's logits); an expert DoRA adapter is refused by `export peft` naming --lora-use-dora and
`export hf --merge`, and its merged HF export, and `logits --adapter` at TP1 (the checkpoint
resharded), equal the trained model's logits."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_lora.convert.errors import ConversionError
from megatron_lora.export.merged import export_merged_hf
from megatron_lora.export.to_peft import export_peft
from megatron_lora.runtime import ParallelLayout
from tests.export import _inference as inference
from tests.export import _support as S
from tests.harness import multirank

RUNS = {"attention": ["linear_qkv", "linear_proj"],
        "experts": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}


def _dora_config(targets):
    from megatron_lora.lora.model import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.1, seed=3,
                      use_dora=True)


@multirank(world_size=4, timeout=600)
def _train_dora(hf, root, tokens, layout=ParallelLayout(pp=2, ep=2)):
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_hf
    from megatron_lora.convert.logits import forward_logits
    from megatron_lora.lora.model import apply_lora
    from megatron_lora.models.build import build_model, model_config
    from megatron_lora.testing.parity import assert_held_by
    from megatron_lora.training.loop import RunConfig, train
    from megatron_lora.training.optimizer import OptimConfig

    info, ckpt, _ = open_hf(hf)
    toks = torch.tensor(json.load(open(tokens)))
    for name, targets in RUNS.items():
        lora = _dora_config(targets)
        model = build_model(info, model_config(info, layout))
        load_hf(model, info, ckpt)
        apply_lora(model, lora, verbose=False)
        run = RunConfig(micro_batch_size=1, global_batch_size=2, seq_length=16, train_iters=3,
                        save=os.path.join(root, name), log_interval=100)
        train([model], S.dataset(), run, OptimConfig(lr=2e-2, train_iters=3, clip_grad=1.0),
              layout_name=layout.describe(), run_metadata={"lora": lora.to_dict()})
        logits = forward_logits(model, toks, info.vocab_size)
        if assert_held_by(logits, 1, "the trained model's logits"):
            save_file({"logits": logits.contiguous()},
                      os.path.join(root, f"{name}_logits.safetensors"))


@pytest.fixture(scope="module")
def dora_runs(tiny, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dora_runs"))
    _train_dora(hf=tiny["hf"], root=root, tokens=tiny["tokens"])
    return dict(tiny, root=root)


def _ours(paths, name):
    return load_file(os.path.join(paths["root"], f"{name}_logits.safetensors"))["logits"]


def test_attention_dora_export_matches_transformers_peft(dora_runs, tmp_path):
    ours = _ours(dora_runs, "attention")
    tokens = torch.tensor(json.load(open(dora_runs["tokens"])))
    out = str(tmp_path / "peft")
    config = export_peft(os.path.join(dora_runs["root"], "attention"), out,
                         hf_config=dora_runs["hf"])
    assert config["use_dora"] is True
    tensors = load_file(os.path.join(out, "adapter_model.safetensors"))
    mags = {k: v for k, v in tensors.items() if k.endswith(".lora_magnitude_vector")}
    modules = {k[:-len(".lora_A.weight")] for k in tensors if k.endswith(".lora_A.weight")}
    assert {k[:-len(".lora_magnitude_vector")] for k in mags} == modules and len(modules) > 0
    for k, v in mags.items():  # one magnitude per output row of its module
        assert v.shape == (tensors[k.replace("lora_magnitude_vector", "lora_B.weight")].shape[0],)
    peft = S.in_both(S.peft_logits, dora_runs["hf"], out, tokens)
    bound = S.assert_near_reference(ours, peft, "trained DoRA logits vs transformers + PEFT")
    S.assert_moved(ours, S.hf_logits(dora_runs["hf"], tokens), bound, "the adapter")
    S.assert_near_reference(ours, S.in_both(S.peft_logits, dora_runs["hf"], out, tokens,
                                            merged=True),
                            "trained DoRA logits vs PEFT's merge_and_unload")
    merged = str(tmp_path / "merged")
    export_merged_hf(dora_runs["mcore"], os.path.join(dora_runs["root"], "attention"), merged,
                     progress=False)
    # the merge's one rounding per weight is of the size of one more matmul's, within K
    S.assert_near_reference(ours, S.in_both(S.hf_logits, merged, tokens),
                            "trained DoRA logits vs transformers on the merged export")

    # import peft of the export gives back the trained checkpoint's tensors bit for bit.
    from megatron_lora.convert.dcp_read import TorchDistCheckpoint
    from megatron_lora.export.from_peft import import_peft
    from megatron_lora.training.checkpoint import resolve

    report = import_peft(out, str(tmp_path / "back"), hf_config=dora_runs["hf"])
    assert report["config"]["use_dora"] is True and not report["notes"]

    def tensors_of(directory):
        ckpt = TorchDistCheckpoint(directory)
        return {k: ckpt.read(k, (0,) * len(ckpt.shape(k)), ckpt.shape(k))
                for k in ckpt.tensors if not k.startswith("optimizer.")}

    original = tensors_of(resolve(os.path.join(dora_runs["root"], "attention")))
    back = tensors_of(str(tmp_path / "back"))
    assert sorted(original) == sorted(back)
    assert any(k.endswith("lora_magnitude_vector") for k in original)
    for key in original:
        assert torch.equal(original[key].view(torch.uint8), back[key].view(torch.uint8)), key

    # A DoRA adapter that leaves k_proj of layer 0 out cannot be imported (its rows' magnitude
    # would be the base weight's norm): refused naming the module.
    import shutil

    partial = str(tmp_path / "partial")
    shutil.copytree(out, partial)
    path = os.path.join(partial, "adapter_model.safetensors")
    kept = {k: v for k, v in load_file(path).items() if "layers.0.self_attn.k_proj" not in k}
    save_file(kept, path)
    with pytest.raises(ConversionError, match=r"layers\.0\.self_attn\.k_proj"):
        import_peft(partial, str(tmp_path / "partial-back"), hf_config=dora_runs["hf"])

    # The trained magnitudes are used: m = ||W + s B A||_row instead changes the logits.
    from peft import PeftModel

    model = PeftModel.from_pretrained(S.hf_model(dora_runs["hf"]), out).eval()
    with torch.no_grad():
        for mod in model.modules():
            mag = getattr(mod, "lora_magnitude_vector", None)
            if mag is not None and "default" in mag:
                w = mod.get_base_layer().weight
                delta = mod.lora_B["default"].weight @ mod.lora_A["default"].weight
                mag["default"].weight.copy_(
                    torch.linalg.norm(w + mod.scaling["default"] * delta, dim=1))
        reset = model(tokens).logits.float()
    S.assert_moved(reset, ours, bound, "resetting the trained magnitudes")


def test_expert_dora_export_refused_and_merged_export_exact(dora_runs, tmp_path):
    run = os.path.join(dora_runs["root"], "experts")
    with pytest.raises(ConversionError, match=r"--lora-use-dora.*export hf\s+--merge"):
        export_peft(run, str(tmp_path / "peft"), hf_config=dora_runs["hf"])
    assert not os.path.exists(tmp_path / "peft" / "adapter_model.safetensors")
    merged = str(tmp_path / "merged")
    export_merged_hf(dora_runs["mcore"], run, merged, progress=False)
    tokens = torch.tensor(json.load(open(dora_runs["tokens"])))
    ours = _ours(dora_runs, "experts")
    # bound: transformers' own fp32 rounding on the merged folder (compare.reference_bound);
    # the merge's one rounding per weight is of the size of one more matmul's, within K
    reference = S.in_both(S.hf_logits, merged, tokens)
    bound = S.assert_near_reference(ours, reference,
                                    "trained expert DoRA logits vs transformers on the merge")
    S.assert_moved(ours, S.hf_logits(dora_runs["hf"], tokens), bound, "the adapter")
    # The checkpoint saved at TP2 (qkv / fc1 magnitudes sharded, fc1's with stride 2) loads at
    # TP1 into a fresh model: `logits --adapter` gives the trained model's logits.
    out = str(tmp_path / "logits.safetensors")
    inference.logits(["--load", dora_runs["mcore"], "--adapter", run, "--tokens",
                      dora_runs["tokens"], "--out", out], world_size=1)  # warm 1-rank world
    S.assert_near_reference(load_file(out)["logits"], reference,
                            "logits --adapter at TP1 vs transformers on the merge")
