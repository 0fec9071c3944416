"""tools/make_tiny_example.py makes a tiny model of every family, with a tokenizer whose chat
template fits it:
- each family's folder converts with `megatron-lora convert hf-to-mcore` (the CLI, in process),
  and is detected as its own family;
- its tokenizer loads (our loader), every id has an embedding row, and a conversation renders
  with the family's turn markers, the assistant's answer (and the turn's end) as the trained span.
One module-scoped build of all the families (about 6 s of conversion each on 2 cores).
"""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = importlib.util.spec_from_file_location(
    "make_tiny_example", os.path.join(ROOT, "tools", "make_tiny_example.py"))
TOOL = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(TOOL)

# family -> (the model_type config.json must hold, a marker the rendered user turn holds)
EXPECTED = {
    "mixtral": ("mixtral", "[INST] "), "qwen3_moe": ("qwen3_moe", "<|im_start|>user\n"),
    "qwen2_moe": ("qwen2_moe", "<|im_start|>user\n"), "olmoe": ("olmoe", "<|user|>\n"),
    "glm4_moe": ("glm4_moe", "[gMASK]<sop><|user|>\n"),
    "deepseek_v3": ("deepseek_v3", "<\uff5cUser\uff5c>"),
    "deepseek_v2": ("deepseek_v2", "<\uff5cUser\uff5c>"),
    "gpt_oss": ("gpt_oss", "<|start|>user<|message|>"),
}


def test_every_family_is_offered():
    assert set(TOOL.FAMILIES) == set(EXPECTED)


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    """{family: its folder}: each made as `--family F` makes it (in process; the session's RNG
    is left as it was) and converted by the CLI into FOLDER/mcore."""
    import torch

    from megatron_lora.cli import main

    root = tmp_path_factory.mktemp("tiny_families")
    made = {}
    with torch.random.fork_rng(devices=[]):
        for family in EXPECTED:
            out = root / family
            os.makedirs(out / "hf")
            TOOL.make_model(str(out / "hf"), family=family)
            texts = TOOL.make_data(str(out / "data.jsonl"), 16)
            TOOL.make_tokenizer(str(out / "hf"), texts + [TOOL.TOKENIZER_TEXT],
                                vocab_size=TOOL.TINY["vocab_size"], family=family)
            code = main(["convert", "hf-to-mcore", "--hf-dir", str(out / "hf"),
                         "--save", str(out / "mcore"), "--no-progress"])
            made[family] = (str(out), code)
    return made


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_the_tiny_example_converts_and_its_chat_template_fits(examples, family):
    from megatron_lora.data.tokenizers import load_tokenizer
    from megatron_lora.families import model_info

    out, code = examples[family]
    model_type, marker = EXPECTED[family]
    assert code == 0
    assert os.path.exists(os.path.join(out, "mcore", "metadata.json"))
    config = json.load(open(os.path.join(out, "hf", "config.json")))
    assert config["model_type"] == model_type
    info = model_info(config)
    tokenizer = load_tokenizer(os.path.join(out, "hf"))
    assert tokenizer.vocab_size <= config["vocab_size"] == info.vocab_size
    messages = [{"role": "user", "content": "red lamp?"},
                {"role": "assistant", "content": "red pmal."}]
    text, spans = tokenizer.chat_template.assistant_spans(messages)
    assert marker in text, text
    assert len(spans) == 1, (text, spans)
    answer = text[spans[0][0]:spans[0][1]]
    # the trained span: the answer and the turn's end, the end-of-sequence token the template
    # writes (one id: the model learns where to stop)
    eos = tokenizer.special_tokens["eos_token"]
    assert "red pmal." in answer and answer.rstrip("\n").endswith(eos), (text, answer)
    assert tokenizer.encode(eos) == [tokenizer.eos_id], (family, eos)
    ids = tokenizer.encode(text)
    unk = tokenizer.encode("<unk>")
    assert max(ids) < tokenizer.vocab_size and unk[0] not in ids, (text, ids)
