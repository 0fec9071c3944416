"""Chat templates: `messages` data tokenized exactly as transformers' apply_chat_template(...,
tokenize=True) tokenizes it (the tokenizers and templates of tests/data/tiny_tokenizers.py), loss
only on the assistant turns, the Mistral [INST] format as the fallback."""

import json
import os

import pytest

from megatron_lora.cli.data_preview import run_texts, runs
from megatron_lora.data import ByteTokenizer, DataError, read_jsonl
from megatron_lora.data.chat import ChatTemplateError
from megatron_lora.data.tokenizers import load_tokenizer
from tests.data.tiny_tokenizers import MISTRAL_TEMPLATE, chatml_folder, mistral_folder

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "I am fine"}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "What colour is the sky?"},
     {"role": "assistant", "content": "blue"},
     {"role": "user", "content": "  caf\u00e9 na\u00efve\n"},
     {"role": "assistant", "content": "Reverse: pmal <s> </s> <|im_end|>\nrats"}],
]
FOLDERS = {
    "mistral": lambda d: mistral_folder(d),
    "mistral-legacy": lambda d: mistral_folder(d, legacy=True),
    "chatml": lambda d: chatml_folder(d),
    "chatml-generation": lambda d: chatml_folder(d, generation=True),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{name: (folder, our tokenizer, transformers' AutoTokenizer)}, each built once."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("chat_tokenizers")
    out = {}
    for name, make in FOLDERS.items():
        folder = make(str(root / name))
        out[name] = (folder, load_tokenizer(folder), AutoTokenizer.from_pretrained(folder))
    return out


def _jsonl(tmp_path, conversations):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return str(path)


def _trained_texts(tok, sample):
    """The text of each run of trained tokens (as data-preview writes it)."""
    spans = [(a, b) for a, b, trained in runs(sample.loss_mask) if trained]
    return run_texts(tok, sample.tokens, spans)


@pytest.mark.parametrize("name", list(FOLDERS))
def test_tokens_equal_transformers_apply_chat_template(folders, name, tmp_path):
    folder, ours, hf = folders[name]
    assert ours.chat_template is not None
    samples, truncated = read_jsonl(_jsonl(tmp_path, CONVERSATIONS), ours, max_tokens=10_000)
    assert truncated == 0 and len(samples) == len(CONVERSATIONS)
    for conversation, sample in zip(CONVERSATIONS, samples):
        expected = hf.apply_chat_template(conversation, tokenize=True, return_dict=False)
        assert sample.tokens == expected, (hf.convert_ids_to_tokens(expected),
                                           ours.decode(sample.tokens, skip_special_tokens=False))
        for prompt in (False, True):  # the text too, with and without the generation prompt
            assert ours.chat_template.render(conversation, add_generation_prompt=prompt) == \
                hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)


def test_generation_blocks_give_transformers_assistant_mask(folders, tmp_path):
    _, ours, hf = folders["chatml-generation"]
    assert ours.chat_template.has_generation_blocks
    samples, _ = read_jsonl(_jsonl(tmp_path, CONVERSATIONS), ours, max_tokens=10_000)
    for conversation, sample in zip(CONVERSATIONS, samples):
        out = hf.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        assert sample.loss_mask == out["assistant_masks"] and sum(sample.loss_mask) > 0


@pytest.mark.parametrize("name,before,after", [("mistral", " ", "</s>"),
                                                ("chatml", "", "<|im_end|>"),
                                                ("chatml-generation", "", "<|im_end|>")])
def test_loss_only_on_assistant_turns_and_their_end(folders, name, before, after, tmp_path):
    """Prefix rendering (and generation blocks) train exactly each answer and the token closing
    its turn, nothing of the system/user turns or the assistant header."""
    _, ours, _ = folders[name]
    conversation = CONVERSATIONS[1]
    (sample,), _ = read_jsonl(_jsonl(tmp_path, [conversation]), ours, max_tokens=10_000)
    answers = [m["content"] for m in conversation if m["role"] == "assistant"]
    assert _trained_texts(ours, sample) == [before + a + after for a in answers]


def test_mistral_template_and_fallback_train_the_same_tokens(tmp_path):
    """On a byte-level BPE (no prefix-space rules), the Mistral template and the fallback format
    (the same folder without a template) give the same tokens and train the same ones:
    ' answer</s>' for each assistant turn."""
    from transformers import AutoTokenizer

    conversation = CONVERSATIONS[1]
    templated_dir = _folder_with_template(tmp_path, MISTRAL_TEMPLATE, "templated",
                                          bos_token="<s>", eos_token="</s>")
    plain_dir = _folder_with_template(tmp_path, None, "plain", bos_token="<s>", eos_token="</s>")
    templated_tok, plain_tok = load_tokenizer(templated_dir), load_tokenizer(plain_dir)
    assert plain_tok.chat_template is None and templated_tok.chat_template is not None
    (templated,), _ = read_jsonl(_jsonl(tmp_path, [conversation]), templated_tok, 10_000)
    (fallback,), _ = read_jsonl(_jsonl(tmp_path, [conversation]), plain_tok, 10_000)
    assert templated.tokens == AutoTokenizer.from_pretrained(templated_dir).apply_chat_template(
        conversation, tokenize=True, return_dict=False)
    assert templated.tokens == fallback.tokens and templated.loss_mask == fallback.loss_mask
    assert _trained_texts(plain_tok, fallback) == [" blue</s>", " " + conversation[-1]["content"]
                                                   + "</s>"]


def test_byte_tokenizer_keeps_mistral_format_and_documents_its_special_ids():
    tok = ByteTokenizer()
    assert tok.chat_template is None
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258, 259)
    assert tok.encode("<s>") == [60, 115, 62]
    assert tok.decode([256, 104, 105, 257, 258], skip_special_tokens=False) == "<s>hi</s><pad>"
    assert tok.decode([256, 104, 105, 257, 258]) == "hi"


def _folder_with_template(tmp_path, template, name="t", **config_changes):
    """The ChatML folder's byte-level tokenizer with another chat template (None: without one)
    and config entries."""
    folder = chatml_folder(str(tmp_path / name))
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(config_changes, chat_template=template)
    if template is None:
        del config["chat_template"]
    with open(path, "w") as f:
        json.dump(config, f)
    return folder


def test_template_errors_name_the_line_and_the_template(tmp_path):
    folder = _folder_with_template(tmp_path, "{% if messages[0]['role'] == 'system' %}"
                                   "{{ raise_exception('no system turns here') }}{% endif %}"
                                   "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    path = _jsonl(tmp_path, [CONVERSATIONS[0], CONVERSATIONS[1]])
    with pytest.raises(DataError, match=r"chat\.jsonl:2: the chat template of .*tokenizer_config"
                                        r"\.json refused the conversation: no system turns here"):
        read_jsonl(path, load_tokenizer(folder), max_tokens=10_000)


def test_template_that_is_not_prefix_stable_is_refused(tmp_path):
    """The system text after the last turn changes with every prefix: no assistant span can be
    located without generation blocks."""
    folder = _folder_with_template(tmp_path, "{% for m in messages %}{{ m['content'] }}|"
                                   "{% endfor %}{{ messages | length }}")
    with pytest.raises(DataError, match=r"chat\.jsonl:1: .* does not render conversations prefix "
                                        r"by prefix .* add \{% generation %\}"):
        read_jsonl(_jsonl(tmp_path, [CONVERSATIONS[1]]), load_tokenizer(folder), max_tokens=100)


@pytest.mark.parametrize("template,message", [
    ("{{ ''.__class__.__mro__ }}", "refused the conversation"),
    ("{% set ns = namespace(_x=1) %}{{ ns }}", "underscore name '_x'"),
    ("{% for m in messages %}", "does not compile"),
])
def test_sandbox_and_syntax_errors(tmp_path, template, message):
    folder = _folder_with_template(tmp_path, template)
    with pytest.raises((DataError, ChatTemplateError), match=message):
        read_jsonl(_jsonl(tmp_path, [CONVERSATIONS[0]]), load_tokenizer(folder), max_tokens=100)


def test_globals_filters_and_special_tokens(folders, tmp_path):
    """strftime_now, tojson without HTML escaping, dict(), loop controls and the special-token
    variables render as transformers renders them."""
    template = ("{{ strftime_now('%Y') | length }} {{ {'a': '<&>'} | tojson }} "
                "{{ dict(k=1) | tojson }} {{ eos_token }}|{{ pad_token }}|{{ bos_token }}|"
                "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{{ m.content }}{% endfor %}")
    folder = _folder_with_template(tmp_path, template)
    from transformers import AutoTokenizer

    ours, hf = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    rendered = ours.chat_template.render(CONVERSATIONS[0])
    assert rendered == hf.apply_chat_template(CONVERSATIONS[0], tokenize=False)
    assert rendered == '4 {"a": "<&>"} {"k": 1} <|im_end|>|<|endoftext|>||Hello there'


def test_template_files_and_named_templates(tmp_path):
    folder = _folder_with_template(tmp_path, [{"name": "tool_use", "template": "x"},
                                              {"name": "other", "template": "y"}])
    with pytest.raises(ChatTemplateError, match="several chat templates \\(other, tool_use\\) "
                                                "and none named 'default'"):
        load_tokenizer(folder)
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    tok = load_tokenizer(folder)  # chat_template.jinja wins over tokenizer_config.json
    assert tok.chat_template.origin.endswith("chat_template.jinja")
    assert tok.chat_template.render(CONVERSATIONS[0]) == "[user]Hello there[assistant]I am fine"
