"""A tokenizer folder's files (tokenizer.json, tokenizer_config.json, special_tokens_map.json,
chat_template.jinja, additional_chat_templates/*.jinja) are read only if they resolve inside the
folder: a symlink to a file elsewhere is refused naming the file, its target and the folder, and
its text is never used. A Hugging Face cache snapshot's links to its own blobs are read."""

import json
import os
import shutil

import pytest

from megatron_lora.data.chat import ChatTemplateError
from megatron_lora.data.tokenizers import TokenizerError, load_tokenizer
from tests.data.tiny_tokenizers import CHATML_TEMPLATE, chatml_folder

SECRET = "{{ 'SECRET FILE TEXT' }}"


@pytest.fixture
def folder(tmp_path):
    """tok/: a ChatML tokenizer folder; outside/secret: a file that is not part of it."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_text(SECRET)
    return tmp_path / chatml_folder(str(tmp_path / "tok"))


def _refused(call, error, link, target, folder):
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and "SECRET" not in message, message
    assert f"{link} resolves to {target}, outside the folder {folder}" in message, message
    return info.value


@pytest.mark.parametrize("name", ["chat_template.jinja",
                                  os.path.join("additional_chat_templates", "default.jinja")])
def test_template_symlinked_out_is_refused(folder, tmp_path, name):
    link = folder / name
    link.parent.mkdir(exist_ok=True)
    os.symlink(tmp_path / "outside" / "secret", link)
    error = _refused(lambda: load_tokenizer(str(folder)), ChatTemplateError, link,
                     tmp_path / "outside" / "secret", folder)
    assert isinstance(error, TokenizerError)  # what the commands report as a user error


def test_preprocess_reports_a_template_symlinked_out_as_one_line(folder, tmp_path, capsys):
    from megatron_lora.cli import main

    os.symlink(tmp_path / "outside" / "secret", folder / "chat_template.jinja")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "yo"}]}) + "\n")
    code = main(["preprocess", "--input", str(data), "--tokenizer", str(folder),
                 "--output-prefix", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert f"{folder / 'chat_template.jinja'} resolves to" in err
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out.")]


def test_template_folder_symlinked_out_is_refused(folder, tmp_path):
    (tmp_path / "outside" / "templates").mkdir()
    shutil.copy(tmp_path / "outside" / "secret", tmp_path / "outside" / "templates" / "x.jinja")
    os.symlink(tmp_path / "outside" / "templates", folder / "additional_chat_templates")
    _refused(lambda: load_tokenizer(str(folder)), ChatTemplateError,
             folder / "additional_chat_templates", tmp_path / "outside" / "templates", folder)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json",
                                  "special_tokens_map.json"])
def test_tokenizer_file_symlinked_out_is_refused(folder, tmp_path, name):
    target = tmp_path / "outside" / name
    if name == "special_tokens_map.json":  # read where the config has no added_tokens_decoder
        target.write_text(json.dumps({"eos_token": "<|im_end|>"}))
    else:
        shutil.move(folder / name, target)  # the real file, moved out and linked back
    os.symlink(target, folder / name)
    _refused(lambda: load_tokenizer(str(folder)), TokenizerError, folder / name, target, folder)


def test_symlinks_inside_the_folder_and_to_the_own_cache_blobs_are_read(tmp_path):
    repo = tmp_path / "hub" / "models--org--chat"
    snap, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    chatml_folder(str(tmp_path / "plain"))
    snap.mkdir(parents=True)
    blobs.mkdir()
    (tmp_path / "plain" / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    for i, name in enumerate(sorted(os.listdir(tmp_path / "plain"))):
        shutil.copy(tmp_path / "plain" / name, blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snap / name)
    tok = load_tokenizer(str(snap))
    assert tok.chat_template is not None and tok.chat_template.source == CHATML_TEMPLATE
    assert tok.encode("hello") == load_tokenizer(str(tmp_path / "plain")).encode("hello")


def test_symlink_to_another_repos_blobs_is_refused(tmp_path):
    hub = tmp_path / "hub"
    snap = hub / "models--org--chat" / "snapshots" / "0123abc"
    other = hub / "models--evil--repo" / "blobs"
    chatml_folder(str(snap))
    other.mkdir(parents=True)
    (other / "f00d").write_text(SECRET)
    os.symlink("../../../models--evil--repo/blobs/f00d", snap / "chat_template.jinja")
    _refused(lambda: load_tokenizer(str(snap)), ChatTemplateError, snap / "chat_template.jinja",
             other / "f00d", snap)
