"""A corpus of hostile checkpoint files: each, read the unsafe way (pickle.load, or torch.load with
weights_only=False), creates a marker file; read as data, it must be refused and create nothing.

`metadata_payloads(marker)`: {name: bytes} for a `.metadata` file (plain pickles).
`torch_payloads(marker)`: {name: bytes} for a torch.save file (common.pt, rng/rank_*.pt, a chunk).
`run_unsafely(kind, data)` reads bytes the way torch and megatron-core did before, to show that
each payload really runs.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile

import torch


def _command(marker: str) -> str:
    return f"touch {marker}"


class _System:
    """Pickles as os.system(command) (a GLOBAL/STACK_GLOBAL of posix.system + REDUCE)."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _str(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def _stack_global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + b"\x93"  # STACK_GLOBAL: protocol 4, dotted names allowed


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"  # GLOBAL (protocols 0-3)


def _call1(callable_ops: bytes, arg_ops: bytes) -> bytes:
    return callable_ops + arg_ops + b"\x85R"  # TUPLE1, REDUCE


def metadata_payloads(marker: str) -> dict:
    cmd = _str(_command(marker))
    dotted = {
        # the module torch's Metadata lives in imports os: `os.system` is a dotted name in it
        "dotted_dcp_metadata_os_system": ("torch.distributed.checkpoint.metadata", "os.system"),
        "dotted_dcp_filesystem_os_system": ("torch.distributed.checkpoint.filesystem", "os.system"),
        "dotted_through_torch_name": ("torch.distributed.checkpoint.metadata",
                                      "torch.serialization.os.system"),
        "dotted_torch_module": ("torch", "serialization.os.system"),
        "dotted_pathlib": ("pathlib", "os.system"),
    }
    out = {
        "reduce_os_system_protocol2": pickle.dumps(_System(_command(marker)), protocol=2),
        "reduce_os_system_protocol4": pickle.dumps(_System(_command(marker)), protocol=4),
        # getattr(__import__("os"), "system")(cmd)
        "builtins_getattr_import": b"\x80\x02" + _global("builtins", "getattr") + _call1(
            _global("builtins", "__import__"), _str("os"))[:-2] + b"\x85R" + _str("system")
        + b"\x86R" + cmd + b"\x85R.",
        "builtins_eval": b"\x80\x02" + _call1(
            _global("builtins", "eval"),
            _str(f"__import__('os').system({_command(marker)!r})")) + b".",
        # a real Metadata whose state_dict_metadata hides the call
        "payload_inside_metadata": pickle.dumps(_metadata_with({"x": _System(_command(marker))}),
                                                protocol=4),
    }
    for name, (module, qualname) in dotted.items():
        out[name] = b"\x80\x04" + _call1(_stack_global(module, qualname), cmd) + b"."
    # the GLOBAL opcode resolves dotted names too once the stream says protocol 4
    out["global_opcode_protocol4_dotted"] = b"\x80\x04" + _call1(
        _global("torch.distributed.checkpoint.metadata", "os.system"), cmd) + b"."
    # pickle.loads, reached through an allowed module, of a plain os.system pickle
    inner = out["reduce_os_system_protocol2"]
    out["dotted_nested_pickle_loads"] = b"\x80\x04" + _call1(
        _stack_global("torch.distributed.checkpoint.filesystem", "pickle.loads"),
        b"C" + bytes([len(inner)]) + inner) + b"."
    return out


def _metadata_with(state_dict_metadata):
    from torch.distributed.checkpoint.metadata import Metadata

    return Metadata(state_dict_metadata=state_dict_metadata)


def _torch_zip(pickle_bytes: bytes) -> bytes:
    """A torch.save zip archive whose data.pkl is `pickle_bytes`."""
    buf = io.BytesIO()
    torch.save({"x": 1}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name in src.namelist():
            z.writestr(name, pickle_bytes if name.endswith("/data.pkl") else src.read(name))
    return out.getvalue()


def torch_payloads(marker: str) -> dict:
    out = {}
    for name, obj in (("zip_common", {"common": _System(_command(marker)), "scheduler": {}}),
                      ("zip_rng", {"torch": torch.zeros(3), "python": _System(_command(marker))}),
                      ("zip_optimizer_state", {"state": {0: {"exp_avg": _System(_command(marker))}}})):
        buf = io.BytesIO()
        torch.save(obj, buf)
        out[name] = buf.getvalue()
    legacy = io.BytesIO()
    torch.save({"common": _System(_command(marker))}, legacy, _use_new_zipfile_serialization=False)
    out["legacy_format"] = legacy.getvalue()
    for name, data in metadata_payloads(marker).items():
        if name != "payload_inside_metadata":
            out[f"zip_{name}"] = _torch_zip(data)
    return out


def run_unsafely(kind: str, data: bytes):
    """Read `data` as torch and megatron-core did: pickle.load for metadata, torch.load with
    weights_only=False for torch files. Errors after the payload ran are ignored."""
    try:
        if kind == "metadata":
            pickle.loads(data)
        else:
            torch.load(io.BytesIO(data), weights_only=False)
    except Exception:
        pass
