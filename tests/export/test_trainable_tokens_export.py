"""Trainable tokens end to end, judged by transformers + PEFT: `megatron-lora train
--add-special-tokens "<|im_start|>" "<|im_end|>" <a> ... <e>` (PP2xEP2 on 4 ranks, LoRA on
attention) on
chat text that uses them: the tiny Mixtral's vocabulary of 250 is padded to 256, so the new ids
250-255 are padded rows and 256 needs a grown vocabulary (384 rows). The adapter reloaded at
TP2+SP (another layout) gives logits over 257 columns that transformers + PEFT reproduce (within
11x their own fp32 rounding, compare.reference_bound) from `export peft`: the extended tokenizer
in the export folder, `resize_token_embeddings(len(tokenizer))`, PeftModel with
`trainable_token_indices`. The new rows moved off their initial (zero, padded) values, and the
adapter changes the logits. `import peft` of the export gives back the trained checkpoint bit for
bit, and so does PEFT's own save of such an adapter; other trainable_token_indices forms are
refused naming the field."""

import copy
import json
import os
import random

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megatron_lora.runtime import ParallelLayout
from tests.export import _support as S
from tests.harness import multirank

NEW = ["<|im_start|>", "<|im_end|>", "<a>", "<b>", "<c>", "<d>", "<e>"]  # ids 250 ... 256
IDS = list(range(250, 257))


def _chat(path: str) -> str:
    rnd = random.Random(0)
    words = "hello there how are you the sky is blue fine thank".split()
    with open(path, "w") as f:
        for _ in range(16):
            user = " ".join(rnd.choice(words) for _ in range(4))
            reply = [rnd.choice(words) for _ in range(2)] + NEW[2:]  # every new token, each step
            rnd.shuffle(reply)
            reply = " ".join(reply)
            text = f"<|im_start|>user {user}<|im_end|><|im_start|>assistant {reply}<|im_end|>"
            f.write(json.dumps({"text": text}) + "\n")
    return path


@multirank(world_size=2, timeout=600)
def _our_logits(hf, run, tokens, out, layout=ParallelLayout(tp=2, sp=True)):
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_hf
    from megatron_lora.convert.logits import forward_logits
    from megatron_lora.export.adapter_ckpt import lora_config_from_dict
    from megatron_lora.lora.model import apply_lora
    from megatron_lora.lora.trainable_tokens import info_for_tokens
    from megatron_lora.models.build import build_model, model_config
    from megatron_lora.testing.parity import assert_held_by
    from megatron_lora.training.checkpoint import load_adapter_weights, read_run_metadata

    info, ckpt, _ = open_hf(hf)
    lora = lora_config_from_dict(read_run_metadata(run)["run_metadata"]["lora"])
    info = info_for_tokens(info, lora.trainable_token_indices)  # 384 rows for id 256
    assert info.shape.vocab_size == 384
    model = build_model(info, model_config(info, layout))
    load_hf(model, info, ckpt)
    apply_lora(model, lora, verbose=False)
    load_adapter_weights([model], run)
    vocab = max(lora.trainable_token_indices) + 1
    logits = forward_logits(model, torch.tensor(json.load(open(tokens))), vocab)
    if assert_held_by(logits, 1, "the logits"):
        save_file({"logits": logits.contiguous()}, out)


@pytest.fixture(scope="module")
def tokens_run(tiny, tmp_path_factory):
    from tests.data.tiny_tokenizers import mistral_folder

    root = tmp_path_factory.mktemp("tokens")
    tok = mistral_folder(str(root / "tok"), vocab_size=250)
    run = str(root / "run")
    proc = S.cli("train", "--load-hf", tiny["hf"], "--tokenizer", tok, "--data-path",
                 _chat(str(root / "chat.jsonl")), "--seq-length", "32", "--global-batch-size",
                 "2", "--train-iters", "3", "--lr", "2e-2", "--lora-rank", "4", "--lora-alpha",
                 "8", "--lora-target-modules", "linear_qkv", "linear_proj",
                 "--add-special-tokens", *NEW, "--save", run, "--log-interval", "10",
                 "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                 nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 250, (2, 12), generator=g)
    ids[0, 2], ids[0, 7], ids[1, 0], ids[1, 9] = 250, 251, 250, 251
    ids[0, 4], ids[0, 10], ids[1, 5] = 256, 253, 255
    tokens = S.write_tokens(str(root / "tokens.json"), ids)
    out = str(root / "ours.safetensors")
    _our_logits(hf=tiny["hf"], run=run, tokens=tokens, out=out)
    return dict(tiny, run=run, tok=tok, ids=ids, ours=out, root=str(root))


def test_trainable_tokens_export_matches_transformers_peft(tokens_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoTokenizer

    from megatron_lora.export.to_peft import export_peft

    out = str(tmp_path / "peft")
    config = export_peft(tokens_run["run"], out, hf_config=tokens_run["hf"])
    assert config["trainable_token_indices"] == {"embed_tokens": IDS, "lm_head": IDS}
    with safe_open(os.path.join(out, "adapter_model.safetensors"), "pt") as f:
        rows = {k: f.get_tensor(k) for k in f.keys() if "trainable_tokens_delta" in k}
    assert len(rows) == 2 and all(r.shape == (7, 64) and r.abs().min() > 0 for r in rows.values())
    tokenizer = AutoTokenizer.from_pretrained(out)  # the extended tokenizer came with it
    assert len(tokenizer) == 257 and tokenizer.convert_tokens_to_ids(NEW) == IDS

    ours = load_file(tokens_run["ours"])["logits"]
    assert ours.shape == (2, 12, 257)
    base = S.hf_model(tokens_run["hf"])
    base.resize_token_embeddings(len(tokenizer))
    twin = copy.deepcopy(base)  # the same resized rows, evaluated in fp64
    with torch.no_grad():
        plain = base(tokens_run["ids"].clamp(max=249)).logits.float()[..., :250]
        peft = tuple(PeftModel.from_pretrained(m, out).eval().to(d)(tokens_run["ids"]).logits
                     for m, d in ((base, torch.float32), (twin, torch.float64)))
    bound = S.assert_near_reference(ours, peft, "logits --adapter (TP2+SP) vs transformers + PEFT")
    S.assert_moved(ours[..., :250], plain, bound, "the adapter")


def test_import_of_the_export_is_bit_identical(tokens_run, tmp_path):
    from megatron_lora.convert.dcp_read import TorchDistCheckpoint
    from megatron_lora.export.from_peft import import_peft
    from megatron_lora.export.to_peft import export_peft
    from megatron_lora.training.checkpoint import resolve

    export_peft(tokens_run["run"], str(tmp_path / "peft"), hf_config=tokens_run["hf"])
    report = import_peft(str(tmp_path / "peft"), str(tmp_path / "back"), hf_config=tokens_run["hf"])
    assert report["config"]["trainable_token_indices"] == IDS

    def tensors(directory):
        ckpt = TorchDistCheckpoint(directory)
        return {k: ckpt.read(k, (0,) * len(ckpt.shape(k)), ckpt.shape(k))
                for k in ckpt.tensors if not k.startswith("optimizer.")}

    original, back = tensors(resolve(tokens_run["run"])), tensors(str(tmp_path / "back"))
    assert "output_layer.trainable_tokens_delta" in original and sorted(original) == sorted(back)
    for key in original:
        assert torch.equal(original[key].view(torch.uint8), back[key].view(torch.uint8)), key


def test_other_trainable_token_forms_are_refused(tokens_run, tmp_path):
    import shutil

    from megatron_lora.convert.errors import ConversionError
    from megatron_lora.export.from_peft import import_peft
    from megatron_lora.export.to_peft import export_peft

    out = str(tmp_path / "peft")
    export_peft(tokens_run["run"], out, hf_config=tokens_run["hf"])
    for value in (IDS, {"embed_tokens": IDS, "lm_head": IDS[::-1]}):
        bad = str(tmp_path / f"bad{len(os.listdir(tmp_path))}")
        shutil.copytree(out, bad)
        cfg = json.load(open(os.path.join(bad, "adapter_config.json")))
        cfg["trainable_token_indices"] = value
        json.dump(cfg, open(os.path.join(bad, "adapter_config.json"), "w"))
        with pytest.raises(ConversionError, match="adapter_config.json: field "
                                                  "trainable_token_indices"):
            import_peft(bad, str(tmp_path / "never"), hf_config=tokens_run["hf"])


def test_peft_s_own_save_imports(tokens_run, tmp_path):
    """A LoRA with trainable_token_indices made and saved by PEFT itself (with the resized base
    copies PEFT adds) imports: the rows land in the checkpoint bit for bit."""
    from peft import LoraConfig, get_peft_model

    from megatron_lora.convert.dcp_read import TorchDistCheckpoint
    from megatron_lora.export.from_peft import import_peft

    model = S.hf_model(tokens_run["hf"])
    model.resize_token_embeddings(257)
    peft = get_peft_model(model, LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj"],
        trainable_token_indices={"embed_tokens": IDS, "lm_head": IDS}))
    g = torch.Generator().manual_seed(4)
    rows = {}
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "trainable_tokens_delta" in name:
                p.copy_(torch.randn(p.shape, generator=g))
                rows["embedding" if "embed_tokens" in name else "output_layer"] = p.clone()
    peft.save_pretrained(str(tmp_path / "peft"))
    import_peft(str(tmp_path / "peft"), str(tmp_path / "back"), hf_config=tokens_run["hf"])
    ckpt = TorchDistCheckpoint(str(tmp_path / "back"))
    for which, key in (("embedding", "embedding.word_embeddings.trainable_tokens_delta"),
                       ("output_layer", "output_layer.trainable_tokens_delta")):
        assert torch.equal(ckpt.read(key, (0, 0), (7, 64)), rows[which]), key
