"""PEFT's own adapters of the kinds a family's training check does not export (DoRA, prefix
tuning), made by PEFT on the family's tiny model, imported, and run by `logits --adapter`.

The reference is PEFT's: `get_peft_model` with non-zero factors (LoRA B random, DoRA's magnitude
from the weights; the prefix table random), saved with `save_pretrained`, loaded back by
`PeftModel.from_pretrained` into transformers' model of the family. Ours is `import peft` of
that save, then the `logits` command's computation on the HF folder with `--adapter` (one
rank, in the warm world: tests/export/_inference.py).
"""

import os

import torch
from safetensors.torch import load_file

from tests.export import _inference as inference
from tests.export import _support as S
from tests.families._support import hf_logits, hf_model

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _peft_config(kind: str):
    from peft import LoraConfig, PrefixTuningConfig

    if kind == "prefix":
        return PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    if kind == "dora":  # B random too (init_lora_weights=False): a zero B hides the update
        return LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, use_dora=True,
                          init_lora_weights=False)
    raise ValueError(kind)


def check_peft_save_gives_peft_logits(paths: dict, kind: str, tmp: str, seed: int = 5) -> float:
    """PEFT's `kind` adapter on paths["hf"], imported: `logits --adapter` within
    compare.reference_bound of PEFT's (11 x PEFT's own fp32 rounding, measured against the same
    model in fp64), and more than 100 x that bound from the base's logits; returns the max abs
    difference."""
    from peft import get_peft_model

    from megatron_lora.export.from_peft import import_peft

    hf, saved, back = paths["hf"], os.path.join(tmp, "peft"), os.path.join(tmp, "imported")
    torch.manual_seed(seed)
    get_peft_model(hf_model(hf), _peft_config(kind)).save_pretrained(saved)
    report = import_peft(saved, back, hf_config=hf)
    assert report["config"].get("use_dora", False) == (kind == "dora"), report["config"]
    out = os.path.join(tmp, "ours.safetensors")
    inference.logits(["--load-hf", hf, "--adapter", back, "--tokens", paths["tokens"], "--out",
                      out], world_size=1)  # the command's computation in the warm 1-rank world
    ours = load_file(out)["logits"]
    tokens = load_file(paths["reference"])["tokens"]
    peft, peft64 = S.in_both(hf_logits, hf, tokens, adapter=saved)
    bound = S.assert_near_reference(ours, (peft, peft64), f"{kind}: vs transformers + PEFT")
    S.assert_moved(peft, hf_logits(hf, tokens), bound, f"{kind}: PEFT's adapter")
    return (ours - peft).abs().max().item()
