"""Files found in a user's folder stay in that folder, symlinks resolved.

A model, tokenizer, adapter or checkpoint folder names files by their place in the folder
(`chat_template.jinja`, `tokenizer.json`, an index's shard names, ...). A symlink among them that
points elsewhere would make any file of the machine an input: a system file read as the chat
template becomes training data. So every such file must resolve (`os.path.realpath`) inside the
folder's own real path, with one allowance, the Hugging Face hub cache:

    .../models--ORG--NAME/snapshots/REV/config.json -> ../../blobs/HASH

A folder at or below `models--ORG--NAME/snapshots/REV` may also hold symlinks to files directly
in that same `models--ORG--NAME/blobs`; a link to another repo's blobs (or anywhere else) is
refused like any other.
"""

from __future__ import annotations

import os
from typing import Optional, Type


class FolderFileError(ValueError):
    """A file of a folder that resolves outside it; the message names file, target and folder."""


def _cache_blobs(root: str) -> Optional[str]:
    """`.../models--ORG--NAME/blobs` when the real folder `root` is a hub-cache snapshot
    (`.../models--ORG--NAME/snapshots/REV`) or lies inside one; else None."""
    parts = root.split(os.sep)
    for i in range(len(parts) - 2, 0, -1):  # the innermost snapshots/REV with a REV after it
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--") and parts[i + 1]:
            return os.sep.join(parts[:i] + ["blobs"])
    return None


def outside_folder(folder: str, path: str) -> Optional[str]:
    """None when `path` resolves inside `folder` (or to a blob of the folder's own hub-cache
    repo); otherwise the real path it resolves to."""
    root = os.path.realpath(folder)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) == root:
        return None
    blobs = _cache_blobs(root)
    if blobs is not None and os.path.dirname(real) == blobs:
        return None
    return real


def check_in_folder(folder: str, path: str, error: Type[Exception] = FolderFileError) -> str:
    """`path` (a file of `folder`) if it resolves inside the folder (module docstring); else
    `error` with one line naming the file, where it resolves and the folder."""
    real = outside_folder(folder, path)
    if real is not None:
        raise error(f"{path} resolves to {real}, outside the folder {os.path.realpath(folder)} "
                    f"(a symlink out of it); only files inside the folder are read (in a Hugging "
                    f"Face cache snapshot also the blobs of its own models--ORG--NAME repo)")
    return path


def folder_file(folder: str, name: str, error: Type[Exception] = FolderFileError) -> str:
    """os.path.join(folder, name), checked by check_in_folder."""
    return check_in_folder(folder, os.path.join(folder, name), error)
