"""megatron-core torch_dist checkpoint -> HF safetensors shards, streamed.

    mcore_to_hf("mixtral-mcore", "Mixtral-8x7B-out", max_shard_bytes=5 * 2**30)

For each chunk of the mapping table (in HF order: embeddings, layer by layer, final norm, head)
the box is read from the checkpoint (from whatever chunks it was stored as, at whatever layout),
split into its HF tensors (fused QKV -> q, k, v; fc1 halves -> w1, w3) and appended to the current
shard file; the padded vocabulary rows are dropped. Writes `model-0000i-of-0000N.safetensors`,
`model.safetensors.index.json`, `config.json`, the tokenizer files kept by hf-to-mcore and the
tensors it carried unchanged (`model-carried.safetensors`: layers the model does not build,
convert/carried.py), into a directory that appears only when complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import List, Tuple

from megatron_lora.convert.atomic import atomic_directory
from megatron_lora.convert.carried import copy_carried, read_carried
from megatron_lora.convert.dcp_read import TorchDistCheckpoint
from megatron_lora.convert.errors import ConversionError
from megatron_lora.convert.fp8 import dequantised_config
from megatron_lora.convert.hf_to_mcore import HF_FILES, read_mcore_info
from megatron_lora.convert.mapping import Chunk, McoreTensor, Zeros, mcore_tensors
from megatron_lora.convert.outputs import prepare_output_dir
from megatron_lora.convert.progress import byte_bar
from megatron_lora.convert.safetensors_write import StreamingSafetensorsWriter, nbytes

DEFAULT_SHARD_BYTES = 5 * 2**30
_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _order(item: Tuple[McoreTensor, Chunk]) -> int:
    name = next(iter(item[1].source.hf_shapes()))
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        return int(m.group(1)) + 1
    return 0 if name.startswith("model.embed_tokens") else 1 << 30


def _check_shapes(ckpt: TorchDistCheckpoint, tensors: List[McoreTensor], info) -> None:
    for t in tensors:
        got = ckpt.shape(t.key)
        ok = got == t.shape or (t.key in _VOCAB_KEYS and got[1:] == t.shape[1:]
                                 and got[0] >= info.vocab_size)
        if not ok:
            raise ConversionError(
                f"{ckpt.directory}: tensor {t.key} has shape {list(got)}, but the config "
                f"({info.config_fields()}) implies {list(t.shape)}")


def mcore_to_hf(load: str, save: str, *, hf_config: str = None,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
                progress: bool = True, transform=None, label: str = "mcore-to-hf") -> None:
    """Stream a torch_dist checkpoint into HF safetensors shards + index + config.json.

    transform(key, chunk, box) -> box, if given, edits each box read from the checkpoint before
    it is split into HF tensors (export/merged.py adds LoRA updates this way).
    """
    prepare_output_dir(save, overwrite=overwrite,
                       inputs={"--load": load, "--hf-config": hf_config})
    info = read_mcore_info(load, hf_config)
    ckpt = TorchDistCheckpoint(load)
    tensors = mcore_tensors(info)
    _check_shapes(ckpt, tensors, info)
    carried = read_carried(load, info)
    items = sorted(((t, c) for t in tensors for c in t.chunks if not isinstance(c.source, Zeros)),
                   key=_order)
    entries = []  # per item: [(hf name, shape, dtype)]
    for t, c in items:
        dtype = ckpt.dtype(t.key)
        entries.append([(n, s, dtype) for n, s in c.source.hf_shapes().items()])
    shards: List[List[int]] = [[]]
    size = 0
    for i, ent in enumerate(entries):
        b = sum(nbytes(s, d) for _, s, d in ent)
        if shards[-1] and size + b > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += b
    total = sum(nbytes(s, d) for ent in entries for _, s, d in ent)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    with atomic_directory(save, overwrite) as tmp, byte_bar(total, label, progress) as bar:
        for file, members in zip(names, shards):
            declared = [e for i in members for e in entries[i]]
            with StreamingSafetensorsWriter(os.path.join(tmp, file), declared) as w:
                for i in members:
                    t, c = items[i]
                    box = ckpt.read(t.key, c.offsets, c.sizes).reshape(c.source.shape)
                    if transform is not None:
                        box = transform(t.key, c, box)
                    for name, tensor in c.source.split(box).items():
                        w.write(name, tensor)
                        weight_map[name] = file
                        bar.update(tensor.nbytes)
                    del box
        total += copy_carried(load, tmp, carried, weight_map)
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(dequantised_config(info.hf_config), f, indent=2)  # the weights are not
        kept = os.path.join(load, HF_FILES)
        if os.path.isdir(kept):
            for name in sorted(os.listdir(kept)):
                shutil.copyfile(os.path.join(kept, name), os.path.join(tmp, name))
