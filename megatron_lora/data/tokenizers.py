"""Tokenizers: a Hugging Face tokenizer folder or `tokenizer.json` (Mixtral's works), or a
built-in byte tokenizer.

An HF tokenizer is tokenized as transformers 5 tokenizes it: the `tokenizer.json` as saved, with
two adjustments read from the `tokenizer_config.json` beside it (when there is one): the named
special tokens it declares are matched in text as single tokens, and a `tokenizer_class` of
`LlamaTokenizer` (Llama, Mistral, Mixtral) gets the pre-tokenizer that class builds (a Metaspace
adding "\u2581" before the first piece only, or before every piece with `"legacy": true`, or
never with `"add_prefix_space": false`; no normalizer). Other tokenizer classes that rebuild
their tokenizer in transformers are not reproduced: the file is used as saved.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

from megatron_lora.data.chat import ChatTemplateError
from megatron_lora.jsonfile import read_json, reason


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used; the message names the file."""


class TemplateFileError(TokenizerError, ChatTemplateError):
    """A tokenizer folder's chat template that cannot be used (unreadable, a symlink out of the
    folder, not compiling): both a TokenizerError and a ChatTemplateError, so every command that
    loads tokenizers reports it as one line."""


class ByteTokenizer:
    """`--tokenizer byte`: UTF-8 bytes as ids 0..255 plus three special ids, 259 in all.

    | id  | token  | use |
    |-----|--------|-----|
    | 256 | `<s>`  | bos_id: first token of every sample |
    | 257 | `</s>` | eos_id: after a text sample and after each trained piece (response, assistant turn) |
    | 258 | `<pad>`| pad_id: fills packed rows, never trained |

    encode() never produces 256-258 (the text "<s>" is the bytes of "<", "s", ">"); decode()
    drops them unless skip_special_tokens=False, which writes them as `<s>`, `</s>`, `<pad>`. It
    has no chat template, so `messages` use the Mistral `[INST]` format. For tiny runs and tests.
    """

    name = "byte"
    SPECIAL = {256: "<s>", 257: "</s>", 258: "<pad>"}

    def __init__(self):
        self.bos_id, self.eos_id, self.pad_id = 256, 257, 258
        self.vocab_size = 259
        self.chat_template = None

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def add_special_tokens(self, tokens: List[str], flag: str = "--add-special-tokens"):
        raise TokenizerError(f"{flag} needs an HF tokenizer (--tokenizer FOLDER or "
                             f"tokenizer.json); the byte tokenizer has a fixed vocabulary")

    def decode(self, ids: List[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        out, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
            else:
                out += [run.decode("utf-8", errors="replace"), self.SPECIAL.get(i, f"<{i}>")]
                run = bytearray()
        return "".join(out) + run.decode("utf-8", errors="replace")


_LLAMA_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast")
_LLAMA_DEFAULTS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


class HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from a tokenizer.json file (no network, no transformers),
    with the `tokenizer_config.json` and chat template files of its folder (module docstring).

    encode() adds no special tokens; bos/eos are the config's `bos_token`/`eos_token` when it
    names them, otherwise found by name in the vocabulary (<s>, </s> for Llama/Mistral/Mixtral),
    and the sample formatter places them. `chat_template` is a ChatTemplate or None.
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        from megatron_lora.data.chat import SPECIAL_TOKEN_NAMES, find_chat_template

        self.name = path
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as exc:  # the tokenizers library raises plain Exception
            raise TokenizerError(f"{path}: not a readable tokenizer.json ({reason(exc)})") from None
        folder = os.path.dirname(os.path.abspath(path))
        config = _read_config(os.path.join(folder, "tokenizer_config.json"))
        self.special_tokens = _special_tokens(folder, config or {})
        if config is not None and config.get("tokenizer_class") in _LLAMA_CLASSES:
            self._llama_pre_tokenizer(config)
        self._add_named_special_tokens()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._named("bos_token", ("<s>", "<|begin_of_text|>", "<bos>"))
        self.eos_id = self._named("eos_token", ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"))
        if self.eos_id is None:
            raise TokenizerError(f"{path}: the tokenizer has no end-of-sequence token (</s> or "
                                 f"similar)")
        pad = self._named("pad_token", ("<pad>", "<unk>"))
        self.pad_id = pad if pad is not None else self.eos_id
        try:
            self.chat_template = find_chat_template(
                folder, {k: v for k, v in self.special_tokens.items() if k in SPECIAL_TOKEN_NAMES},
                config)
        except ChatTemplateError as exc:  # a tokenizer folder's problem for every CLI
            raise TemplateFileError(str(exc)) from None

    def _llama_pre_tokenizer(self, config: dict) -> None:
        from tokenizers import pre_tokenizers

        if config.get("add_prefix_space", True) is False:
            scheme = "never"
        else:
            scheme = "always" if config.get("legacy", False) else "first"
        self._tok.normalizer = None
        self._tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme=scheme, split=False)

    def _add_named_special_tokens(self) -> None:
        from tokenizers import AddedToken

        added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        missing = [t for t in self.special_tokens.values() if t not in added]
        if missing:
            self._tok.add_special_tokens([AddedToken(t, special=True) for t in dict.fromkeys(missing)])

    def _named(self, key: str, names) -> Optional[int]:
        if key in self.special_tokens:
            return self._tok.token_to_id(self.special_tokens[key])
        for name in names:
            idx = self._tok.token_to_id(name)
            if idx is not None:
                return idx
        return None

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def add_special_tokens(self, tokens: List[str], flag: str = "--add-special-tokens") -> List[int]:
        """Add `tokens` as new special tokens (matched in text as single tokens, ids vocab_size,
        vocab_size + 1, ... in order); returns their ids. A token the vocabulary already has (or
        a repeated one) is a TokenizerError naming it and `flag`. `save()` writes the result."""
        from tokenizers import AddedToken

        tokens = list(tokens)
        for t in tokens:
            if not isinstance(t, str) or not t:
                raise TokenizerError(f"{flag}: {t!r} is not a token (a non-empty string)")
            if self._tok.token_to_id(t) is not None:
                raise TokenizerError(f"{flag} {t!r}: the tokenizer {self.name} already has this "
                                     f"token (id {self._tok.token_to_id(t)}); list only new tokens")
        if len(set(tokens)) != len(tokens):
            raise TokenizerError(f"{flag}: tokens repeated in {tokens}")
        first = self.vocab_size
        self._tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                      for t in tokens])
        ids = [self._tok.token_to_id(t) for t in tokens]
        if ids != list(range(first, first + len(tokens))):  # holes in the vocabulary
            raise TokenizerError(f"{flag}: {tokens} got ids {ids}, not the next ones after the "
                                 f"tokenizer's {first} tokens ({self.name})")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.added = list(getattr(self, "added", [])) + tokens
        return ids

    def save(self, folder: str) -> str:
        """Write this tokenizer, with the tokens add_special_tokens() added, as an HF tokenizer
        folder (tokenizer.json as read plus those tokens, tokenizer_config.json declaring them,
        the chat template files copied); transformers' AutoTokenizer loads it. Returns folder."""
        import json
        import shutil

        from tokenizers import AddedToken, Tokenizer

        os.makedirs(folder, exist_ok=True)
        source = os.path.dirname(os.path.abspath(self.name))
        added = list(getattr(self, "added", []))
        tok = Tokenizer.from_file(self.name)  # as saved: the in-memory pipeline may be rebuilt
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
        tok.save(os.path.join(folder, "tokenizer.json"))
        config = _read_config(os.path.join(source, "tokenizer_config.json"))
        if config is not None:
            if isinstance(config.get("added_tokens_decoder"), dict):
                for t in added:
                    config["added_tokens_decoder"][str(tok.token_to_id(t))] = {
                        "content": t, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True}
            extra = [x for x in config.get("additional_special_tokens") or [] if x not in added]
            config["additional_special_tokens"] = extra + added
            with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
                json.dump(config, f, indent=2, ensure_ascii=False)
        for name in ("special_tokens_map.json", "chat_template.jinja", "chat_template.json"):
            if os.path.lexists(os.path.join(source, name)):
                _in_folder(os.path.join(source, name))
            if os.path.isfile(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(folder, name))
        return folder

    def encode_with_special_tokens(self, text: str) -> List[int]:
        """transformers' tokenizer(text).input_ids: tokenizer.json's post-processor places the
        special tokens (Mixtral's: <s> first)."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def encode_with_offsets(self, text: str) -> Tuple[List[int], List[Tuple[int, int]]]:
        """ids of `text` and each token's [start, end) character range in it."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, [tuple(o) for o in enc.offsets]

    def decode(self, ids: List[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _in_folder(path: str) -> str:
    """`path`, a file of a tokenizer folder, if it resolves inside that folder (a symlink out
    would read any file of the machine as tokenizer data); else TokenizerError."""
    from megatron_lora.runtime.folder_files import check_in_folder

    return check_in_folder(os.path.dirname(os.path.abspath(path)), path, TokenizerError)


def _read_config(path: str) -> Optional[dict]:
    if os.path.lexists(path):
        _in_folder(path)
    if not os.path.isfile(path):
        return None
    config = read_json(path, TokenizerError)
    if not isinstance(config, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return config


def _token_string(value) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or {"content": str, ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _special_tokens(folder: str, config: dict) -> Dict[str, str]:
    """Named special tokens (bos_token, eos_token, ...) as strings: tokenizer_config.json's, then
    a legacy special_tokens_map.json's where the config has no added_tokens_decoder, then the
    defaults of LlamaTokenizer for that class."""
    from megatron_lora.data.chat import SPECIAL_TOKEN_NAMES

    sources = [config]
    legacy = os.path.join(folder, "special_tokens_map.json")
    if "added_tokens_decoder" not in config and os.path.isfile(legacy):
        mapping = _read_config(legacy)
        sources.append(mapping or {})
    if config.get("tokenizer_class") in _LLAMA_CLASSES:
        sources.append(_LLAMA_DEFAULTS)
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        for source in sources:
            if name in source:
                token = _token_string(source[name])
                if token is not None:
                    tokens[name] = token
                break
    return tokens


def load_training_tokenizer(spec: str, new_tokens: List[str], model_vocab: int,
                            padded_vocab: Optional[int], flag: str = "--add-special-tokens"):
    """(tokenizer, ids of new_tokens) for training: `--tokenizer spec` extended with new_tokens
    (HFTokenizer.add_special_tokens). The tokenizer's own vocabulary must fit the model's
    (model_vocab rows); with padded_vocab given, the new ids must fall in the model's padded
    vocabulary (megatron's padding to a multiple), else a TokenizerError naming `flag`; None:
    the vocabulary may grow (the caller builds the model for the ids)."""
    tokenizer = load_tokenizer(spec)
    if tokenizer.vocab_size > model_vocab:
        raise TokenizerError(f"--tokenizer has {tokenizer.vocab_size} tokens, more than the "
                             f"model's vocab_size {model_vocab}")
    if not new_tokens:
        return tokenizer, []
    free = (padded_vocab or 0) - tokenizer.vocab_size
    if padded_vocab is not None and len(new_tokens) > free:
        raise TokenizerError(
            f"{flag}: {len(new_tokens)} new tokens do not fit: the tokenizer has "
            f"{tokenizer.vocab_size} tokens and the model's padded vocabulary {padded_vocab} rows "
            f"(vocab_size {model_vocab} padded to a multiple of 128), so {max(free, 0)} rows are "
            f"free; growing the vocabulary needs the base from --load-hf")
    return tokenizer, tokenizer.add_special_tokens(list(new_tokens), flag)


def load_tokenizer(spec: str):
    """`byte`, a tokenizer.json file, or an HF model directory that holds one. The
    tokenizer_config.json and chat template files are read from the folder of the tokenizer.json
    either way."""
    if spec == "byte":
        return ByteTokenizer()
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    if os.path.isdir(spec) and os.path.lexists(path):
        _in_folder(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"--tokenizer {spec!r}: expected 'byte', a tokenizer.json file, or a directory "
            f"containing tokenizer.json (looked for {path})"
        )
    return HFTokenizer(path)
