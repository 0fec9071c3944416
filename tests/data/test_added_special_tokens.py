"""--add-special-tokens in the tokenizer (data/tokenizers.py): new tokens get the next ids, are
matched in text as single tokens, and the saved folder tokenizes as transformers does; a token
the vocabulary has, too many tokens for the padded vocabulary and the byte tokenizer are clear
errors naming the flag."""

import pytest

from megatron_lora.data.tokenizers import TokenizerError, load_tokenizer, load_training_tokenizer
from tests.data.tiny_tokenizers import mistral_folder

NEW = ["<|im_start|>", "<|im_end|>"]
TEXT = "hi <|im_start|>user there<|im_end|>"


def test_added_tokens_get_the_next_ids_and_save_as_transformers_reads_them(tmp_path):
    from transformers import AutoTokenizer

    folder = mistral_folder(str(tmp_path / "tok"), vocab_size=250)
    tok, ids = load_training_tokenizer(folder, NEW, 250, 256)
    assert ids == [250, 251] and tok.vocab_size == 252
    encoded = tok.encode(TEXT)
    assert encoded.count(250) == 1 and encoded.count(251) == 1
    saved = tok.save(str(tmp_path / "saved"))
    hf = AutoTokenizer.from_pretrained(saved)
    assert len(hf) == 252
    assert hf(TEXT, add_special_tokens=False).input_ids == encoded
    again = load_tokenizer(saved)
    assert again.encode(TEXT) == encoded
    with pytest.raises(TokenizerError, match=r"--add-special-tokens '<\|im_end\|>'.*already has"):
        again.add_special_tokens(["<|im_end|>"])


def test_too_many_tokens_for_the_padded_vocabulary_and_byte_are_refused(tmp_path):
    # (train grows the vocabulary with --load-hf: padded_vocab=None; see info_for_tokens)
    folder = mistral_folder(str(tmp_path / "tok"), vocab_size=250)
    with pytest.raises(TokenizerError, match="--add-special-tokens: 7 new tokens do not fit.*6 "
                                             "rows are free; growing the vocabulary needs the "
                                             "base from --load-hf"):
        load_training_tokenizer(folder, [f"<t{i}>" for i in range(7)], 250, 256)
    with pytest.raises(TokenizerError, match="--add-special-tokens needs an HF tokenizer"):
        load_training_tokenizer("byte", NEW, 259, 384)
    with pytest.raises(TokenizerError, match="already has"):
        load_training_tokenizer(folder, ["<s>"], 250, 256)
