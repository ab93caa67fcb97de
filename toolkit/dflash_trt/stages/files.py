"""Files the stages share: replicating checkpoint directories, and their sizes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def link_or_copy_tree(src: Path, dst: Path) -> str:
    """Replicate a directory with hard links (same filesystem) or copies; return which."""
    how = "hardlink"

    def link_or_copy(s: str, d: str) -> None:
        nonlocal how
        try:
            os.link(s, d)
        except OSError:  # another filesystem, or links not allowed
            how = "copy"
            shutil.copy2(s, d)

    shutil.copytree(src, dst, copy_function=link_or_copy, symlinks=False)
    return how


def copy_tree(src: Path, dst: Path) -> None:
    """A plain copy of a directory (contents only, no metadata)."""
    shutil.copytree(src, dst, copy_function=shutil.copyfile)


def dir_bytes(path: Path) -> int:
    """Total bytes of the files under path."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
