"""data/chat_limits.py: a hostile chat template ends in one ChatTemplateError naming its file,
within a few seconds and a few MiB, from the library (render, read_jsonl, preprocess) and the
`preprocess` command; ordinary templates render as before (tests/data/test_chat.py compares
them with transformers)."""

import json
import os
import time

import pytest

from megatron_lora.data import DataError, read_jsonl
from megatron_lora.data.chat import ChatTemplate, ChatTemplateError, ChatTemplateLimitError
from megatron_lora.data.chat_limits import MAX_RENDER_CHARS, MAX_RENDER_SECONDS
from megatron_lora.data.preprocess import PreprocessError, preprocess
from megatron_lora.data.tokenizers import load_tokenizer
from tests.data.tiny_tokenizers import template_folder

CHAT = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "fine"}]
# Each would run for hours (or allocate gigabytes) without the limits.
RUNAWAY = {
    "nested loops": "{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}"
                    "{% endfor %}",
    "silent nested loops": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
                           "{% endfor %}",
    "long output": "{% for i in range(99999) %}{{ messages | tojson }}{% endfor %}",
    "string product": "{{ 'x' * 10**9 }}",
    "doubling": "{% set ns = namespace(s='x') %}{% for i in range(60) %}"
                "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "power": "{{ 10 ** (10 ** 9) }}",
    "width": "{{ 'x' | center(10**9) }}{{ 'x'.ljust(10**9) }}",
    "format width": "{{ '%999999999d' % 1 }}",
}
TIME = f"rendering took longer than {MAX_RENDER_SECONDS:g} s (MAX_RENDER_SECONDS)"
OUTPUT = f"the rendering is longer than {MAX_RENDER_CHARS} characters (MAX_RENDER_CHARS)"
LIMITS = {  # what the message says (one of)
    "nested loops": (OUTPUT, TIME),  # whichever comes first on this machine
    "silent nested loops": (TIME,),
    "long output": (OUTPUT,),
    "string product": ("the operator '*' would build 1000000000 characters or items",),
    "doubling": ("a concatenation built a value of",),
    "power": ("the operator '**' would build an integer of more than 65536 bits",),
    "width": ("the filter 'center' was given 1000000000",),
    "format width": ("the operator '%' was given 999999999",),
}
FAILS = {
    "include": ("{% include 'other.jinja' %}", "does not compile: {% include %} loads another "
                "template, which a chat template cannot do (line 1)"),
    "import": ("{% import 'macros.jinja' as m %}", "does not compile: {% import %} loads"),
    "from import": ("{% from 'm.jinja' import f %}", "does not compile: {% from %} loads"),
    "extends": ("{% extends 'base.jinja' %}", "does not compile: {% extends %} loads"),
    "syntax": ("{% for m in messages %}", "does not compile: Unexpected end of template"),
    "deep nesting": ("{{ " + "(" * 20000 + "1" + ")" * 20000 + " }}",
                     "does not compile: RecursionError"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                  "cannot be used: it recursed too deeply"),
    "big range": ("{% for i in range(10**6) %}{% endfor %}",
                  "cannot be used: range() of 1000000 items, more than 100000 (MAX_RANGE_ITEMS)"),
    "type error": ("{{ messages[0].content + 1 }}", "refused the conversation: TypeError: "),
    "division": ("{{ 1 // 0 }}", "refused the conversation: ZeroDivisionError: "),
}


def _timed(call):
    start = time.monotonic()
    try:
        call()
    except ChatTemplateError as exc:
        return exc, time.monotonic() - start
    pytest.fail("no ChatTemplateError")


@pytest.mark.parametrize("name", list(RUNAWAY))
def test_a_runaway_template_stops_within_the_limits(name):
    exc, seconds = _timed(lambda: ChatTemplate(RUNAWAY[name], "/models/t.jinja", {}).render(CHAT))
    assert isinstance(exc, ChatTemplateLimitError)
    assert str(exc).startswith("the chat template of /models/t.jinja cannot be used: ")
    assert any(m in str(exc) for m in LIMITS[name]), str(exc)
    assert seconds < MAX_RENDER_SECONDS + 3, seconds


@pytest.mark.parametrize("name", list(FAILS))
def test_templates_that_fail_name_their_file_in_one_line(name):
    source, message = FAILS[name]
    exc, seconds = _timed(lambda: ChatTemplate(source, "/models/t.jinja", {}).render(CHAT))
    assert "/models/t.jinja" in str(exc) and message in str(exc), str(exc)
    assert "\n" not in str(exc) and seconds < 5


def test_the_limits_leave_loops_filters_and_macros_of_real_templates_alone():
    """loop.* variables, recursive loops, macros with caller(), set blocks, ~ and filters
    render as Jinja renders them."""
    import jinja2.sandbox

    source = ("{% macro box(x) %}[{{ x }}{{ caller() }}]{% endmacro %}"
              "{% for m in messages %}{{ loop.index }}/{{ loop.length }}"
              "{% if loop.last %}!{% endif %}{% call box(m.role) %}{{ m.content | upper }}"
              "{% endcall %}{% endfor %}{% set s %}{{ messages | length ~ '-' }}{% endset %}"
              "{{ s * 3 }}{% for x in [[1, [2]], [3]] recursive %}({% if x is iterable %}"
              "{{ loop(x) }}{% else %}{{ x }}{% endif %}){% endfor %}"
              "{{ range(3) | list | join(',') }}{{ '%05d' | format(7) }}{{ '{:>4}'.format(1) }}")
    plain = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    expected = plain.from_string(source).render(messages=CHAT)
    assert ChatTemplate(source, "t", {}).render(CHAT) == expected
    assert expected.startswith("1/2[userHELLO THERE]2/2![assistantFINE]2-2-2-")


def _jsonl(tmp_path, n=3):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(n)))
    return str(path)


def test_read_jsonl_stops_at_a_limit_naming_the_line_and_the_template(tmp_path):
    folder = template_folder(str(tmp_path / "tok"), RUNAWAY["silent nested loops"])
    exc, seconds = _timed(lambda: read_jsonl(_jsonl(tmp_path), load_tokenizer(folder), 100))
    assert isinstance(exc, ChatTemplateLimitError) and seconds < MAX_RENDER_SECONDS + 3
    assert str(exc).startswith(f"{tmp_path / 'chat.jsonl'}:1: the chat template of "
                               f"{folder}/tokenizer_config.json cannot be used: rendering took "
                               f"longer than")


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_stops_at_a_limit_even_when_skipping_bad_lines(tmp_path, workers):
    """Every line would take MAX_RENDER_SECONDS: the run stops at the first, with or without
    --skip-bad-lines, in the worker processes too, and writes nothing."""
    folder = template_folder(str(tmp_path / "tok"), RUNAWAY["string product"])
    data = _jsonl(tmp_path, n=20)
    start = time.monotonic()
    with pytest.raises(PreprocessError, match=rf"^{data}:\d+: the chat template of .* cannot be "
                                              r"used: the operator '\*' would build"):
        preprocess([data], folder, str(tmp_path / "out"), workers=workers, chunk_lines=2,
                   skip_bad_lines=True, progress_interval=-1)
    assert time.monotonic() - start < 60
    assert sorted(os.listdir(tmp_path)) == ["chat.jsonl", "tok"]


@pytest.mark.parametrize("template,message", [
    ([{"name": "default"}], "'chat_template' must be a string or a list of"),
    (5, "'chat_template' must be a string or a list of"),
    ("{% include 'x' %}", "the chat template does not compile: {% include %} loads"),
])
def test_preprocess_reports_a_template_that_cannot_be_loaded(tmp_path, template, message):
    folder = template_folder(str(tmp_path / "tok"), template)
    with pytest.raises(PreprocessError) as info:
        preprocess([_jsonl(tmp_path)], folder, str(tmp_path / "out"), progress_interval=-1)
    assert str(info.value).startswith(f"--tokenizer {folder}: {folder}/tokenizer_config.json")
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("template", ["", "  \n ", "{% for m in messages %} {% endfor %}"])
def test_a_template_that_renders_nothing_is_refused(tmp_path, template):
    folder = template_folder(str(tmp_path / "tok"), template)
    data = _jsonl(tmp_path)
    blank = (f"the chat template of {folder}/tokenizer_config.json rendered only whitespace "
             f"for this conversation, no tokens to train on")
    with pytest.raises(DataError, match=f"^{data}:1: {blank}$"):
        read_jsonl(data, load_tokenizer(folder), 100)
    with pytest.raises(PreprocessError, match=rf"^{data}:1: {blank} \(pass --skip-bad-lines"):
        preprocess([data], folder, str(tmp_path / "out"), progress_interval=-1)
    with pytest.raises(PreprocessError, match=rf"^--input {data}: no samples \(3 bad lines "
                                              rf"skipped, the first: {data}:1: {blank}\)$"):
        preprocess([data], folder, str(tmp_path / "out"), skip_bad_lines=True,
                   progress_interval=-1)
    assert sorted(os.listdir(tmp_path)) == ["chat.jsonl", "tok"]


def test_a_template_that_marks_no_assistant_text_is_refused(tmp_path):
    """Text, but only the user's: no sample has a token to train on, so no prefix is written."""
    folder = template_folder(str(tmp_path / "tok"), "{% for m in messages %}"
                             "{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}")
    data = _jsonl(tmp_path)
    with pytest.raises(PreprocessError) as info:
        preprocess([data], folder, str(tmp_path / "out"), progress_interval=-1)
    assert str(info.value).startswith(f"--input {data}: no sample produced a token to train on "
                                      f"(3 samples, ")
    assert str(info.value).endswith(f"the chat template of {folder}/tokenizer_config.json marks "
                                    f"no assistant text in any of them")
    assert sorted(os.listdir(tmp_path)) == ["chat.jsonl", "tok"]
