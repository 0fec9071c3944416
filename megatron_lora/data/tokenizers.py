"""Tokenizers: a Hugging Face `tokenizer.json` (Mixtral's works) or a built-in byte tokenizer."""

from __future__ import annotations

import os
from typing import List, Optional

from megatron_lora.jsonfile import reason


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used; the message names the file."""


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then <s>=256, </s>=257, <pad>=258. For tiny runs and tests."""

    name = "byte"

    def __init__(self):
        self.bos_id, self.eos_id, self.pad_id = 256, 257, 258
        self.vocab_size = 259

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: List[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from a tokenizer.json file (no network, no transformers).

    encode() adds no special tokens; bos/eos come from the tokenizer's vocabulary (<s>, </s> for
    Llama/Mistral/Mixtral) and the sample formatter places them.
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.name = path
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as exc:  # the tokenizers library raises plain Exception
            raise TokenizerError(f"{path}: not a readable tokenizer.json ({reason(exc)})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special(("<s>", "<|begin_of_text|>", "<bos>"))
        self.eos_id = self._special(("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"))
        if self.eos_id is None:
            raise TokenizerError(f"{path}: the tokenizer has no end-of-sequence token (</s> or "
                                 f"similar)")
        pad = self._special(("<pad>", "<unk>"))
        self.pad_id = pad if pad is not None else self.eos_id

    def _special(self, names) -> Optional[int]:
        for name in names:
            idx = self._tok.token_to_id(name)
            if idx is not None:
                return idx
        return None

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: List[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(spec: str):
    """`byte`, a tokenizer.json file, or an HF model directory that holds one."""
    if spec == "byte":
        return ByteTokenizer()
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"--tokenizer {spec!r}: expected 'byte', a tokenizer.json file, or a directory "
            f"containing tokenizer.json (looked for {path})"
        )
    return HFTokenizer(path)
