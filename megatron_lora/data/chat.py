"""Chat templates: a tokenizer's own Jinja template, rendered the way transformers renders it.

Where the template comes from (an HF tokenizer folder, see `find_chat_template`):
`chat_template.jinja` (plus `additional_chat_templates/NAME.jinja`) when present, otherwise the
`chat_template` of `tokenizer_config.json`, a string or a list of `{"name", "template"}` entries.
Of several named templates the one named `default` is used.

How it is rendered (the settings of transformers' `apply_chat_template`): a sandboxed Jinja
environment that refuses attribute changes (`ImmutableSandboxedEnvironment`) with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension and a `{% generation %}` block tag;
the globals `raise_exception(msg)`, `strftime_now(fmt)`, a `dict(...)` constructor and a
`namespace(...)` refusing underscore names; a `tojson` filter that does not escape HTML. The
template sees `messages`, `tools=None`, `documents=None`, `add_generation_prompt` and the
tokenizer's named special tokens as strings (`bos_token`, `eos_token`, `unk_token`, `sep_token`,
`pad_token`, `cls_token`, `mask_token`, those that are set). The rendered text is tokenized with
no special tokens added: the template writes them.

Which tokens are trained (`ChatTemplate.assistant_spans`):
- a template with `{% generation %}...{% endgeneration %}` blocks: the text those blocks write
  (what transformers' `return_assistant_tokens_mask` marks);
- otherwise by prefix rendering: for the i-th message, an assistant turn, its span is the text
  between the rendering of messages[:i] with `add_generation_prompt=True` and the rendering of
  messages[:i+1] (the answer and whatever the template closes the turn with, e.g. `</s>` or
  `<|im_end|>`). A template whose renderings of the prefixes are not prefixes of the whole
  conversation is refused with a message saying to add `{% generation %}` blocks.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Dict, List, Optional, Tuple, Union

Span = Tuple[int, int]  # [start, end) character offsets into the rendered text
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """A chat template that cannot be read, compiled or rendered; the message says where."""


class ChatTemplateLimitError(ChatTemplateError):
    """A rendering that reached a limit of data/chat_limits.py (time, size, recursion): the
    template is at fault whatever the conversation, so callers stop instead of skipping it."""


def _environment():
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils

    from megatron_lora.data.chat_limits import BoundedSandbox

    class GenerationBlocks(jinja2.ext.Extension):
        """`{% generation %}body{% endgeneration %}`: writes body and, while a recorder is set
        on the environment, records the [start, end) character span it occupies."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_record"), [], [], body) \
                .set_lineno(lineno)

        def _record(self, caller):
            text = caller()
            recorder = getattr(self.environment, "generation_recorder", None)
            if recorder is not None:
                start = recorder.written()
                recorder.spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class DictConstructor:
        """`dict(...)` and `dict.fromkeys(...)` only; no access to the dict type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def refuse_underscore(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not store the underscore name {name!r} on a namespace")

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # noqa: N805 - Jinja's own signature trick
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for key in attrs:
                refuse_underscore(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            refuse_underscore(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = env.guarded_filter("tojson", tojson)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                       dict=DictConstructor(), namespace=Namespace)
    return env


class _Recorder:
    """The text written so far by one `Template.generate` run, and the generation spans."""

    def __init__(self):
        self.pieces: List[str] = []
        self.spans: List[Span] = []

    def written(self) -> int:
        return sum(len(p) for p in self.pieces)


def _messages_for_template(messages: List[dict]) -> List[dict]:
    """What transformers hands the template: keys whose value is None dropped, and a message's
    reasoning (`reasoning_content`, `thinking` or `reasoning`) also under `thinking` and
    `reasoning_content`."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning")
                          if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatTemplate:
    """One compiled chat template and the special-token strings it is rendered with.

    `source` is the Jinja text, `origin` names the file it came from (for messages), and
    `special_tokens` maps names like `bos_token` to token strings.
    """

    def __init__(self, source: str, origin: str, special_tokens: Dict[str, str]):
        import jinja2

        self.source, self.origin = source, origin
        self.special_tokens = dict(special_tokens)
        from megatron_lora.data.chat_limits import compile_bounded

        self._env = _environment()
        try:
            self._template = compile_bounded(self._env, source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"{origin}: the chat template does not compile: "
                                    f"{exc.message} (line {exc.lineno})") from None
        except Exception as exc:  # noqa: BLE001 - the source is untrusted: deep nesting, ...
            raise ChatTemplateError(f"{origin}: the chat template does not compile: "
                                    f"{_one_line(exc)}") from None
        self.has_generation_blocks = "generation" in _block_tags(self._env, source)

    def _run(self, messages: List[dict], add_generation_prompt: bool) -> _Recorder:
        from megatron_lora.data.chat_limits import RenderBudget

        recorder = _Recorder()
        budget = RenderBudget()
        self._env.generation_recorder, self._env.render_budget = recorder, budget
        try:
            for piece in self._template.generate(
                    messages=_messages_for_template(messages), tools=None, documents=None,
                    add_generation_prompt=add_generation_prompt, **self.special_tokens):
                budget.wrote(piece)
                recorder.pieces.append(piece)
        finally:
            self._env.generation_recorder = self._env.render_budget = None
        return recorder

    def render(self, messages: List[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as text, exactly as transformers' apply_chat_template(...,
        tokenize=False) writes it. Template errors (raise_exception included) become
        ChatTemplateError."""
        return "".join(self._checked_run(messages, add_generation_prompt).pieces)

    def _checked_run(self, messages, add_generation_prompt) -> _Recorder:
        """_run, every failure a ChatTemplateError naming the template: a limit reached
        (chat_limits.py; a recursion without end; memory) a ChatTemplateLimitError, anything
        else (raise_exception, the sandbox, a TypeError on the data...) a refusal."""
        import jinja2

        from megatron_lora.data.chat_limits import RenderLimitExceeded

        try:
            return self._run(messages, add_generation_prompt)
        except RenderLimitExceeded as exc:
            problem = str(exc)
        except RecursionError:
            problem = "it recursed too deeply (a macro or recursive loop calling itself)"
        except MemoryError:
            problem = "it ran out of memory"
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template of {self.origin} refused the "
                                    f"conversation: {_one_line(exc)}") from None
        except Exception as exc:  # noqa: BLE001 - the template is untrusted code
            raise ChatTemplateError(f"the chat template of {self.origin} refused the "
                                    f"conversation: {_one_line(exc)}") from None
        raise ChatTemplateLimitError(f"the chat template of {self.origin} cannot be used: "
                                     f"{problem}")

    def assistant_spans(self, messages: List[dict]) -> Tuple[str, List[Span]]:
        """(rendered text, [start, end) character spans of the assistant turns to train on).

        With `{% generation %}` blocks, their spans; otherwise by prefix rendering (module
        docstring). Raises ChatTemplateError if prefix rendering does not line up.
        """
        whole = self._checked_run(messages, False)
        text = "".join(whole.pieces)
        if self.has_generation_blocks:
            return text, [s for s in whole.spans if s[1] > s[0]]
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self._prefix(messages[:i])
            through = self.render(messages[:i + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise ChatTemplateError(
                    f"the chat template of {self.origin} does not render conversations "
                    f"prefix by prefix (the text before assistant message {i} changes with what "
                    f"follows), so the assistant turns cannot be located; add "
                    f"{{% generation %}}...{{% endgeneration %}} around the assistant text")
            if len(through) > len(before):
                spans.append((len(before), len(through)))
        return text, spans


    def _prefix(self, messages: List[dict]) -> str:
        """The text before an assistant turn: `messages` with the generation prompt; for an
        assistant turn that opens the conversation, "" if the template cannot render no
        messages."""
        try:
            return self.render(messages, add_generation_prompt=True)
        except ChatTemplateError:
            if messages:
                raise
            return ""


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line, with its type when that says more than the text."""
    import jinja2

    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, jinja2.exceptions.TemplateError) else \
        f"{type(exc).__name__}: {text}"


def _block_tags(env, source: str) -> set:
    """The names of the `{% tag %}` statements in `source` (from the lexer, so text that only
    looks like a tag inside a string literal does not count)."""
    tags, after_open = set(), False
    for _, kind, value in env.lex(source):
        if kind == "block_begin":
            after_open = True
        elif after_open and kind == "name":
            tags.add(value)
            after_open = False
        elif kind != "whitespace":
            after_open = False
    return tags


def find_chat_template(folder: str, special_tokens: Dict[str, str],
                       config: Optional[dict]) -> Optional[ChatTemplate]:
    """The chat template of an HF tokenizer folder, or None when it has none.

    `chat_template.jinja` and `additional_chat_templates/*.jinja` take precedence over
    `config["chat_template"]` (the parsed tokenizer_config.json, a string or a list of named
    templates), as in transformers; of several templates the one named `default` is used.
    """
    templates: Dict[str, Tuple[str, str]] = {}  # name -> (source, origin)
    main = os.path.join(folder, "chat_template.jinja")
    extra_dir = os.path.join(folder, "additional_chat_templates")
    if os.path.lexists(main) and _inside(folder, main) and os.path.isfile(main):
        templates["default"] = (_read_text(main, folder), main)
    if os.path.isdir(extra_dir) and _inside(folder, extra_dir):
        for entry in sorted(os.listdir(extra_dir)):
            if entry.endswith(".jinja"):
                path = os.path.join(extra_dir, entry)
                templates[entry[:-len(".jinja")]] = (_read_text(path, folder), path)
    if not templates and config is not None and config.get("chat_template") is not None:
        origin = os.path.join(folder, "tokenizer_config.json")
        templates = _config_templates(config["chat_template"], origin)
    if not templates:
        return None
    if "default" not in templates:
        raise ChatTemplateError(
            f"{next(iter(templates.values()))[1]}: several chat templates "
            f"({', '.join(sorted(templates))}) and none named 'default'")
    source, origin = templates["default"]
    return ChatTemplate(source, origin, special_tokens)


def _config_templates(value: Union[str, list], origin: str) -> Dict[str, Tuple[str, str]]:
    if isinstance(value, str):
        return {"default": (value, origin)}
    if isinstance(value, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: (t["template"], f"{origin} (chat_template {t['name']!r})")
                for t in value}
    raise ChatTemplateError(f"{origin}: 'chat_template' must be a string or a list of "
                            f"{{'name': str, 'template': str}}")


def _inside(folder: str, path: str) -> bool:
    """True, or ChatTemplateError when `path` (a file or folder of the tokenizer folder)
    resolves outside it: a symlink out would make any file of the machine the template."""
    from megatron_lora.runtime.folder_files import check_in_folder

    check_in_folder(folder, path, ChatTemplateError)
    return True


def _read_text(path: str, folder: str) -> str:
    """The text of template file `path` of the tokenizer folder `folder` (it must resolve inside
    it: _inside)."""
    _inside(folder, path)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"{path}: cannot read the chat template ({exc})") from None


def trained_mask(offsets: List[Tuple[int, int]], spans: List[Span]) -> List[int]:
    """1 for each token whose character range [start, end) overlaps a span, else 0 (how
    transformers marks assistant tokens; a token straddling a span's edge is trained)."""
    mask, k = [], 0
    for start, end in offsets:
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        mask.append(int(k < len(spans) and end > spans[k][0]))
    return mask
