import json

import pytest

from megatron_lora.data import ByteTokenizer, DataError, read_jsonl
from megatron_lora.data.tokenizers import load_tokenizer


def _write(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n")
    return str(path)


def test_text_prompt_response_and_messages(tmp_path):
    tok = ByteTokenizer()
    path = _write(tmp_path, [
        {"text": "ab"},
        {"prompt": "Q", "response": "A"},
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                      {"role": "assistant", "content": "R"}]},
    ])
    (text, sft, chat), truncated = read_jsonl(path, tok, max_tokens=100)
    assert truncated == 0
    assert text.tokens == [256, ord("a"), ord("b"), 257] and text.loss_mask == [1, 1, 1, 1]
    assert sft.tokens == [256, ord("Q"), ord("A"), 257] and sft.loss_mask == [0, 0, 1, 1]
    prompt = "[INST] S\n\nU [/INST]"
    assert tok.decode(chat.tokens) == prompt + " R"
    assert chat.loss_mask == [0] * (1 + len(prompt)) + [1, 1, 1]  # " R" and </s>


@pytest.mark.parametrize("line,expected", [
    ('{"text": "ok"', "data.jsonl:2: not valid JSON"),
    ('[1, 2]', "data.jsonl:2: expected a JSON object"),
    ('{"prompt": "p"}', "data.jsonl:2: 'prompt' and 'response' must both be strings"),
    ('{"messages": [{"role": "user", "content": "u"}]}', "data.jsonl:2: 'messages' has no assistant turn"),
    ('{"messages": [{"role": "bot", "content": "u"}]}', "data.jsonl:2: messages[0] must be"),
    ('{"title": "x"}', "data.jsonl:2: expected a 'text', 'prompt'/'response' or 'messages' field"),
])
def test_malformed_lines_name_file_and_line(tmp_path, line, expected):
    path = _write(tmp_path, [{"text": "fine"}, line])
    with pytest.raises(DataError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        read_jsonl(path, ByteTokenizer(), max_tokens=100)


def test_long_samples_are_truncated_and_counted(tmp_path):
    path = _write(tmp_path, [{"text": "x" * 50}, {"text": "y"}, {"text": "z" * 9}])
    samples, truncated = read_jsonl(path, ByteTokenizer(), max_tokens=10)
    assert truncated == 2
    assert [len(s.tokens) for s in samples] == [10, 3, 10]


def test_tokenizer_json_from_file_or_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    for spec in (str(tmp_path), str(tmp_path / "tokenizer.json")):
        loaded = load_tokenizer(spec)
        assert (loaded.bos_id, loaded.eos_id, loaded.vocab_size) == (1, 2, 5)
        assert loaded.encode("hello world") == [3, 4]
    with pytest.raises(FileNotFoundError, match="expected 'byte', a tokenizer.json file"):
        load_tokenizer(str(tmp_path / "missing"))
