import os

import pytest
import torch
from safetensors.torch import save_file

from megatron_lora.runtime import ParallelLayout
from tests.convert.tiny import make_tiny_mixtral, make_tokens
from tests.export import _support as S
from tests.harness import multirank

TRAIN_LAYOUT = ParallelLayout(tp=2, pp=2, ep=2, sp=True)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A tiny HF Mixtral (vocabulary 250, padded to 256 by megatron), its torch_dist conversion
    and token ids."""
    from megatron_lora.convert.hf_to_mcore import hf_to_mcore

    root = tmp_path_factory.mktemp("export_tiny")
    paths = {"hf": str(root / "hf"), "mcore": str(root / "mcore"), "root": str(root)}
    make_tiny_mixtral(paths["hf"], seed=5)
    hf_to_mcore(paths["hf"], paths["mcore"], progress=False)
    paths["tokens"] = S.write_tokens(str(root / "tokens.json"), make_tokens(batch=2, seq=12))
    return paths


@multirank(world_size=8, timeout=900)
def _train(hf, save, out, tokens, layout=TRAIN_LAYOUT):
    import json

    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_hf
    from megatron_lora.convert.logits import forward_logits
    from megatron_lora.lora.model import apply_lora
    from megatron_lora.models.build import build_model, model_config
    from megatron_lora.testing.parity import assert_held_by
    from megatron_lora.training.loop import RunConfig, train
    from megatron_lora.training.optimizer import OptimConfig

    info, ckpt, _ = open_hf(hf)
    model = build_model(info, model_config(info, layout))
    load_hf(model, info, ckpt)
    apply_lora(model, S.LORA, verbose=False)
    run = RunConfig(micro_batch_size=1, global_batch_size=4, seq_length=16, train_iters=3,
                    save=save, log_interval=100)
    train([model], S.dataset(), run, OptimConfig(lr=2e-2, train_iters=3, clip_grad=1.0),
          layout_name=layout.describe(), run_metadata={"lora": S.LORA.to_dict()})
    toks = torch.tensor(json.load(open(tokens)))
    logits = forward_logits(model, toks, info.vocab_size)
    if assert_held_by(logits, 1, "the trained model's logits"):
        save_file({"logits": logits.contiguous()}, out)


@pytest.fixture(scope="session")
def trained(tiny):
    """LoRA trained 3 steps at TP2xPP2xEP2+SP (8 ranks): the run folder and the trained model's
    own logits (in memory, before any export)."""
    paths = dict(tiny)
    paths["run"] = os.path.join(tiny["root"], "run")
    paths["train_logits"] = os.path.join(tiny["root"], "train_logits.safetensors")
    _train(hf=tiny["hf"], save=paths["run"], out=paths["train_logits"], tokens=tiny["tokens"])
    return paths
