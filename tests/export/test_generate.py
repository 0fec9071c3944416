"""`megatron-lora generate` with the adapter trained at TP2xPP2xEP2+SP, greedy, equals
transformers + PEFT generate(do_sample=False) with the exported adapter, token for token, at
TP2+SP (every step padded to the TP size) and PP2xEP2; prompts (text and chat messages) are
tokenized as transformers' tokenizer does, and completions decode as transformers decodes."""

import json
import os

import pytest
import torch

from megatron_lora.export.to_peft import export_peft
from tests.data.tiny_tokenizers import mistral_folder
from tests.export import _support as S

NEW_TOKENS = 12
PROMPTS = [  # odd and even lengths, so sequence parallelism pads prefill and every step
    {"prompt": "Hello there, how are you"},
    {"prompt": "The sky is blue.", "id": 7},
    {"messages": [{"role": "user", "content": "What colour is the sky?"}]},
]


@pytest.fixture(scope="module")
def gen(trained, tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    paths = dict(trained, tok=mistral_folder(str(root / "tok"), vocab_size=240),
                 prompts=str(root / "prompts.jsonl"), peft=str(root / "peft"))
    with open(paths["prompts"], "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in PROMPTS)
    export_peft(trained["run"], paths["peft"], hf_config=trained["hf"])
    return paths


@torch.no_grad()
def _transformers_generate(gen, with_adapter: bool = True):
    """[(prompt ids, new ids, decoded completion)] from transformers (+ PEFT)."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gen["tok"])
    model = S.hf_model(gen["hf"])
    if with_adapter:
        model = PeftModel.from_pretrained(model, gen["peft"]).eval()
    out = []
    for p in PROMPTS:
        if "prompt" in p:
            ids = tok(p["prompt"]).input_ids
        else:
            ids = tok.apply_chat_template(p["messages"], tokenize=True,
                                          add_generation_prompt=True)["input_ids"]
        full = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        new = full[0, len(ids):].tolist()
        out.append((ids, new, tok.decode(new, skip_special_tokens=True)))
    return out


@pytest.fixture(scope="module")
def reference(gen):
    return _transformers_generate(gen)


@pytest.mark.parametrize("flags,nproc,to_file", [
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, True),
    (["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"], 4, False),
], ids=["TP2+SP", "PP2xEP2"])
def test_greedy_generate_matches_transformers_peft(gen, reference, flags, nproc, to_file,
                                                   tmp_path):
    """(PP2xEP2 without --out: the completions come on stdout, once, from rank 0.)"""
    out = str(tmp_path / "out.jsonl")
    proc = S.cli("generate", "--load", gen["mcore"], "--adapter", gen["run"], "--tokenizer",
                 gen["tok"], "--prompts", gen["prompts"], *(["--out", out] if to_file else []),
                 "--max-new-tokens", str(NEW_TOKENS), *flags, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ms per token" in proc.stderr
    if to_file:
        rows = [json.loads(line) for line in open(out)]
    else:
        assert not os.path.exists(out)
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["token_ids"] for r in rows] == [new for _, new, _ in reference]
    assert [r["completion"] for r in rows] == [text for _, _, text in reference]
    for row, prompt in zip(rows, PROMPTS):  # the prompt's own fields come back with the result
        assert {k: row[k] for k in prompt} == prompt
    assert all(len(r["token_ids"]) == NEW_TOKENS or r["token_ids"][-1] == 2 for r in rows)


def test_the_adapter_changes_what_is_generated(gen, reference):
    """Guards the comparison above: without the adapter transformers generates other tokens."""
    base = _transformers_generate(gen, with_adapter=False)
    assert [new for _, new, _ in base] != [new for _, new, _ in reference]


def test_prompt_tokens_are_transformers(gen, reference):
    from megatron_lora.data.tokenizers import load_tokenizer
    from megatron_lora.inference.prompts import prompt_ids

    tok = load_tokenizer(gen["tok"])
    ours = [prompt_ids(tok, p, f"prompt {i}") for i, p in enumerate(PROMPTS)]
    assert ours == [ids for ids, _, _ in reference]
    assert ours[2][0] == tok.bos_id  # the chat template writes <s>; plain text gets none here
    assert os.path.isfile(os.path.join(gen["tok"], "tokenizer.json"))
