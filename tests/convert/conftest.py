import os

import pytest
from safetensors.torch import save_file

from tests.convert.tiny import hf_logits, make_tiny_mixtral, make_tokens, write_tokens


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory):
    """Paths of a tiny HF Mixtral, its converted torch_dist checkpoint, token ids and the
    transformers eager logits for them."""
    from megatron_lora.convert.hf_to_mcore import hf_to_mcore

    root = tmp_path_factory.mktemp("tiny_mixtral")
    paths = {k: str(root / k) for k in ("hf", "mcore")}
    make_tiny_mixtral(paths["hf"])
    hf_to_mcore(paths["hf"], paths["mcore"], progress=False)
    tokens = make_tokens()
    paths["tokens"] = str(root / "tokens.json")
    write_tokens(paths["tokens"], tokens)
    paths["reference"] = str(root / "reference.safetensors")
    save_file({"tokens": tokens, "logits": hf_logits(paths["hf"], tokens).contiguous()},
              paths["reference"])
    assert os.path.isfile(os.path.join(paths["mcore"], ".metadata"))
    return paths


@pytest.fixture(scope="session")
def tiny_tied(tmp_path_factory):
    """Like tiny_mixtral, with tied input/output embeddings (no lm_head.weight on disk)."""
    root = tmp_path_factory.mktemp("tiny_tied")
    paths = {"hf": str(root / "hf"), "reference": str(root / "reference.safetensors")}
    make_tiny_mixtral(paths["hf"], seed=3, tie_word_embeddings=True)
    tokens = make_tokens(batch=2)
    save_file({"tokens": tokens, "logits": hf_logits(paths["hf"], tokens).contiguous()},
              paths["reference"])
    return paths
