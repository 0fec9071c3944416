"""Prefix tuning out to and in from Hugging Face PEFT (PREFIX_TUNING), judged by transformers +
PEFT. `megatron-lora train --peft-type prefix --num-virtual-tokens 3` at PP2 (2 ranks, 3 steps),
once without and once with `--prefix-projection` (encoder hidden size 24), then:

- `export peft` writes the adapter_config.json fields and the safetensors tensor
  (`prompt_embeddings` [3, 4 layers * 2 * 32]) that PEFT's own save of the same config has;
- transformers + PeftModel.from_pretrained of the export give the logits of `logits --adapter`
  at TP2+SP (another layout, the checkpoint resharded) over a batch, within 11x PEFT's own fp32
  rounding (compare.reference_bound), and the prefix moves the logits far from the base's;
- greedy `generate --adapter` (TP2+SP, KV cache) gives the tokens of a greedy loop over
  transformers + PEFT forwards. (PEFT 0.21.2's own `generate` drops the prefix on transformers
  5.24: its prepare_inputs_for_generation looks for `past_key_values`, which transformers now
  passes as `cache`, so it decodes as the base model does; the loop is the oracle.)
- `import peft` of the export gives back the trained table bit for bit (with projection: the
  table the export computed);
- PEFT's own saves (PrefixTuningConfig on the tiny model, PEFT's random init, with and without
  projection) import bit for bit, and the imported adapter gives PEFT's logits;
- `export hf --merge` refuses a prefix adapter (points to export peft); malformed PEFT configs
  and files, other prompt-learning types and checkpoints that do not fit the model are refused
  naming the file and the field or tensor.
"""

import json
import os
import random
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_lora.convert.errors import ConversionError
from tests.export import _inference as inference
from tests.export import _support as S

N = 3  # virtual tokens
ENC = 24  # encoder hidden size with projection
PROMPTS = ["Hello there, how are you", "The sky is blue."]
NEW_TOKENS = 8
MODES = {"table": [], "projection": ["--prefix-projection", "--prefix-encoder-hidden-size",
                                     str(ENC)]}


def _text(path: str) -> str:
    rnd = random.Random(0)
    words = "hello there how are you the sky is blue fine thank colour lamp star".split()
    with open(path, "w") as f:
        for _ in range(16):
            f.write(json.dumps({"text": " ".join(rnd.choice(words) for _ in range(10))}) + "\n")
    return path


def _ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    """Both modes trained at PP2 (the parity of prefix tuning at every layout is
    tests/lora/test_prefix.py's), exported (the projection one through the CLI) and their
    logits from `logits --adapter` at TP2+SP."""
    from megatron_lora.export.to_peft import export_peft
    from tests.data.tiny_tokenizers import mistral_folder

    root = tmp_path_factory.mktemp("prefix")
    paths = dict(tiny, tok=mistral_folder(str(root / "tok"), vocab_size=250))
    data = _text(str(root / "text.jsonl"))
    for i, (mode, flags) in enumerate(MODES.items()):
        run, peft, logits = (str(root / f"{mode}_{x}") for x in ("run", "peft", "logits"))
        _ok(S.cli("train", "--load-hf", tiny["hf"], "--tokenizer", paths["tok"], "--data-path",
                  data, "--seq-length", "16", "--global-batch-size", "2", "--train-iters", "3",
                  "--lr", "2e-2", "--peft-type", "prefix", "--num-virtual-tokens", str(N), *flags,
                  "--pipeline-model-parallel-size", "2",
                  "--save", run, "--log-interval", "10", nproc=2))
        if mode == "projection":
            proc = _ok(S.cli("export", "peft", "--adapter", run, "--load-hf", tiny["hf"],
                             "--save", peft))
            assert "PREFIX_TUNING" in proc.stderr and "note: prefix_projection" in proc.stderr
        else:
            export_peft(run, peft, hf_config=tiny["hf"])
        inference.logits(["--load-hf", tiny["hf"], "--adapter", run, "--tokens", tiny["tokens"],
                          "--out", logits, "--tensor-model-parallel-size", "2",
                          "--sequence-parallel"])  # in the warm 2-rank world
        paths[mode] = {"run": run, "peft": peft, "logits": logits}
    return paths


def _peft_save(hf: str, out: str, projection: bool, seed: int) -> str:
    """PEFT's own PREFIX_TUNING save on the tiny model (its random init)."""
    from peft import PrefixTuningConfig, get_peft_model

    torch.manual_seed(seed)
    config = PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=N,
                                prefix_projection=projection,
                                encoder_hidden_size=ENC if projection else None)
    get_peft_model(S.hf_model(hf), config).save_pretrained(out)
    return out


def _tokens(paths) -> torch.Tensor:
    return torch.tensor(json.load(open(paths["tokens"])))


@pytest.mark.parametrize("mode", list(MODES))
def test_export_writes_what_peft_writes(runs, mode, tmp_path):
    ours = runs[mode]["peft"]
    theirs = _peft_save(runs["hf"], str(tmp_path / "peft"), mode == "projection", seed=0)
    mine = json.load(open(os.path.join(ours, "adapter_config.json")))
    peft = json.load(open(os.path.join(theirs, "adapter_config.json")))
    assert set(peft) - set(mine) == {"peft_version"} and set(mine) <= set(peft)
    differ = {k for k in mine if mine[k] != peft[k]}
    if mode == "projection":  # the CLI: base_model_name_or_path is the --load-hf folder
        assert mine["base_model_name_or_path"] == runs["hf"] and not differ, differ
    else:  # the library without base_model: null, where PEFT names the model it wrapped
        assert mine["base_model_name_or_path"] is None
        assert differ == {"base_model_name_or_path"}, {k: (mine[k], peft[k]) for k in differ}
    assert mine["token_dim"] == 32 and mine["num_attention_heads"] == 2  # GQA: kv heads
    a, b = (load_file(os.path.join(d, "adapter_model.safetensors")) for d in (ours, theirs))
    assert list(a) == list(b) == ["prompt_embeddings"]
    assert a["prompt_embeddings"].shape == b["prompt_embeddings"].shape == (N, 4 * 2 * 32)
    assert a["prompt_embeddings"].dtype == b["prompt_embeddings"].dtype == torch.float32


@pytest.mark.parametrize("mode", list(MODES))
def test_logits_match_transformers_peft(runs, mode):
    tokens = _tokens(runs)
    ours = load_file(runs[mode]["logits"])["logits"]
    peft = S.in_both(S.peft_logits, runs["hf"], runs[mode]["peft"], tokens)
    bound = S.assert_near_reference(ours, peft,
                                    f"{mode}: logits --adapter (TP2+SP) vs transformers + PEFT")
    S.assert_moved(ours, S.hf_logits(runs["hf"], tokens), bound, "the prefix")


@torch.no_grad()
def _greedy(model, ids, steps: int, eos: int):
    """Greedy decoding by full forwards (no cache): the argmax of the last position each step."""
    seq = list(ids)
    for _ in range(steps):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        if seq[-1] == eos:
            break
    return seq[len(ids):]


def test_greedy_generate_matches_transformers_peft(runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoTokenizer

    prompts = str(tmp_path / "prompts.jsonl")
    with open(prompts, "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in PROMPTS)
    out = str(tmp_path / "out.jsonl")
    inference.generate(["--load", runs["mcore"], "--adapter", runs["table"]["run"],
                        "--tokenizer", runs["tok"], "--prompts", prompts, "--out", out,
                        "--max-new-tokens", str(NEW_TOKENS), "--tensor-model-parallel-size", "2",
                        "--sequence-parallel"])  # in the warm 2-rank world
    ours = [json.loads(line)["token_ids"] for line in open(out)]
    tok = AutoTokenizer.from_pretrained(runs["tok"])
    ids = [tok(p).input_ids for p in PROMPTS]
    base = S.hf_model(runs["hf"])
    plain = [_greedy(base, i, NEW_TOKENS, tok.eos_token_id) for i in ids]
    model = PeftModel.from_pretrained(base, runs["table"]["peft"]).eval()
    reference = [_greedy(model, i, NEW_TOKENS, tok.eos_token_id) for i in ids]
    assert ours == reference
    assert ours != plain  # the prefix changes what is generated


def _stored(directory: str) -> dict:
    from megatron_lora.convert.dcp_read import TorchDistCheckpoint

    ckpt = TorchDistCheckpoint(directory)
    return {k: ckpt.read(k, (0,) * len(ckpt.shape(k)), ckpt.shape(k))
            for k in ckpt.tensors if not k.startswith("optimizer.")}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8),
                                                                     b.view(torch.uint8))


@pytest.mark.parametrize("mode", list(MODES))
def test_import_of_the_export_is_bit_identical(runs, mode, tmp_path):
    from megatron_lora.export.adapter_ckpt import PREFIX_KV, AdapterCheckpoint
    from megatron_lora.families import read_hf_config
    from megatron_lora.training.checkpoint import resolve

    back = str(tmp_path / "back")
    if mode == "projection":  # through the CLI, which says how it imported the projection
        proc = _ok(S.cli("import", "peft", "--adapter", runs[mode]["peft"], "--load-hf",
                         runs["hf"], "--save", back))
        assert f"num_virtual_tokens={N}, prefix_projection=False" in proc.stderr
        assert "prefix_projection=true, but PEFT saves only the projected" in proc.stderr
    else:
        from megatron_lora.export.from_peft import import_peft

        report = import_peft(runs[mode]["peft"], back, hf_config=runs["hf"])
        assert report["ranks"] == {} and not report["notes"]
    got = _stored(back)
    assert list(got) == [PREFIX_KV] and got[PREFIX_KV].shape == (4, N, 2, 2, 16)
    if mode == "table":  # the trained tensor itself
        assert _bits_equal(got[PREFIX_KV], _stored(resolve(runs[mode]["run"]))[PREFIX_KV])
    table = AdapterCheckpoint(runs[mode]["run"], read_hf_config(runs["hf"])).prefix_table()
    again = AdapterCheckpoint(back, read_hf_config(runs["hf"])).prefix_table()
    assert table.abs().min() > 0 and _bits_equal(again, table)


def test_peft_s_own_saves_import_and_give_peft_s_logits(runs, tmp_path):
    from megatron_lora.export.adapter_ckpt import AdapterCheckpoint
    from megatron_lora.export.from_peft import import_peft
    from megatron_lora.families import read_hf_config

    info = read_hf_config(runs["hf"])
    for projection in (False, True):
        saved = _peft_save(runs["hf"], str(tmp_path / f"peft{int(projection)}"), projection,
                           seed=11)
        back = str(tmp_path / f"back{int(projection)}")
        report = import_peft(saved, back, hf_config=runs["hf"])
        assert report["config"]["num_virtual_tokens"] == N
        assert report["config"]["prefix_projection"] is False
        assert bool(report["notes"]) == projection
        table = load_file(os.path.join(saved, "adapter_model.safetensors"))["prompt_embeddings"]
        assert _bits_equal(AdapterCheckpoint(back, info).prefix_table(), table)
    tokens = _tokens(runs)
    out = str(tmp_path / "ours.safetensors")
    inference.logits(["--load-hf", runs["hf"], "--adapter", back, "--tokens", runs["tokens"],
                      "--out", out], world_size=1)  # in the warm 1-rank world
    peft = S.in_both(S.peft_logits, runs["hf"], saved, tokens)
    S.assert_near_reference(load_file(out)["logits"], peft,
                            "PEFT's own save (prefix_projection=True), imported, TP1, vs PEFT")


def test_merged_export_refused(runs, tmp_path):
    from megatron_lora.export.merged import export_merged_hf

    out = str(tmp_path / "merged")
    with pytest.raises(ConversionError, match="prefix-tuning adapter .* cannot be merged into "
                                              "the weights. Export it with `export peft`"):
        export_merged_hf(runs["mcore"], runs["table"]["run"], out, progress=False)
    assert not os.path.exists(out)


_DROP = object()  # a field left out


def _edited(source: str, tmp_path, name: str, **changes) -> str:
    bad = str(tmp_path / name)
    shutil.copytree(source, bad)
    path = os.path.join(bad, "adapter_config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump({k: v for k, v in cfg.items() if v is not _DROP}, open(path, "w"))
    return bad


@pytest.mark.parametrize("change,needle", [
    pytest.param({"peft_type": "PROMPT_TUNING"}, "peft_type='PROMPT_TUNING'", id="prompt"),
    pytest.param({"peft_type": "P_TUNING"}, "peft_type='P_TUNING'", id="p-tuning"),
    pytest.param({"task_type": "SEQ_2_SEQ_LM"}, "field task_type", id="task"),
    pytest.param({"num_transformer_submodules": 2}, "field num_transformer_submodules",
                 id="submodules"),
    pytest.param({"num_virtual_tokens": "3"}, "field num_virtual_tokens", id="n-string"),
    pytest.param({"num_virtual_tokens": _DROP}, "'num_virtual_tokens' is missing", id="n-missing"),
    pytest.param({"num_layers": 3}, "field num_layers=3", id="layers"),
    pytest.param({"token_dim": 64}, "field token_dim=64", id="token-dim"),
    pytest.param({"num_attention_heads": 4}, "field num_attention_heads=4", id="heads"),
    pytest.param({"prefix_projection": "yes"}, "field prefix_projection", id="projection"),
    pytest.param({"encoder_hidden_size": 0}, "field encoder_hidden_size", id="encoder"),
    pytest.param({"modules_to_save": ["lm_head"]}, "field modules_to_save", id="modules"),
    pytest.param({"num_virtual_tokens": 4}, "'prompt_embeddings'", id="n-vs-file"),
])
def test_malformed_peft_prefix_configs_refused(runs, tmp_path, change, needle):
    from megatron_lora.export.from_peft import import_peft

    bad = _edited(runs["table"]["peft"], tmp_path, "bad", **change)
    with pytest.raises(ConversionError, match=re.escape(f"{bad}/adapter_")) as exc:
        import_peft(bad, str(tmp_path / "never"), hf_config=runs["hf"])
    assert needle in str(exc.value), str(exc.value)
    assert not os.path.exists(str(tmp_path / "never"))


def test_malformed_peft_prefix_files_refused(runs, tmp_path):
    from megatron_lora.export.from_peft import import_peft

    source = runs["table"]["peft"]
    table = load_file(os.path.join(source, "adapter_model.safetensors"))["prompt_embeddings"]
    for name, tensors, needle in (
            ("extra", {"prompt_embeddings": table, "other": table.clone()}, "found ['other'"),
            ("short", {"prompt_embeddings": table[:, :-1].contiguous()}, "[3, 255]"),
            ("int", {"prompt_embeddings": table.long()}, "I64")):
        bad = str(tmp_path / name)
        shutil.copytree(source, bad)
        save_file(tensors, os.path.join(bad, "adapter_model.safetensors"))
        with pytest.raises(ConversionError, match="adapter_model.safetensors") as exc:
            import_peft(bad, str(tmp_path / "never"), hf_config=runs["hf"])
        assert needle in str(exc.value), str(exc.value)


def test_checkpoints_that_do_not_fit_are_refused(runs, tmp_path):
    from megatron_lora.export.adapter_ckpt import AdapterCheckpoint
    from megatron_lora.families import read_hf_config
    from megatron_lora.training.checkpoint import resolve

    # another model: the stored [4, 3, 2, 2, 16] does not fit 2 layers
    shallow = str(tmp_path / "shallow")
    os.makedirs(shallow)
    cfg = json.load(open(os.path.join(runs["hf"], "config.json")))
    json.dump(dict(cfg, num_hidden_layers=2), open(os.path.join(shallow, "config.json"), "w"))
    run = resolve(runs["table"]["run"])
    # the recorded base (4 layers) refuses it first; told the base is intended, the shapes do
    with pytest.raises(ConversionError, match=r"differing: num_layers"):
        AdapterCheckpoint(run, read_hf_config(shallow))
    with pytest.raises(ConversionError, match=r"prefix_kv has shape \[4, 3, 2, 2, 16\].*"
                                              r"implies \[2, 3, 2, 2, 16\]") as exc:
        AdapterCheckpoint(run, read_hf_config(shallow), allow_other_base=True)
    assert run in str(exc.value)
    # a config that says projection over a table-only checkpoint: the missing tensor is named
    from megatron_lora.export.from_peft import import_peft
    from megatron_lora.runtime.safe_load import safe_torch_load

    edited = str(tmp_path / "edited")
    import_peft(runs["table"]["peft"], edited, hf_config=runs["hf"])
    common = safe_torch_load(os.path.join(edited, "common.pt"))  # written by the import
    common["common"]["run_metadata"]["lora"].update(prefix_projection=True)
    torch.save(common, os.path.join(edited, "common.pt"))
    with pytest.raises(ConversionError, match="prefix_proj_weight is missing"):
        AdapterCheckpoint(edited, read_hf_config(runs["hf"]))
