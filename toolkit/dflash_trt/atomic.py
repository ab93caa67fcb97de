"""Writing outputs so that readers never see half of one: a temporary sibling, then a rename."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Write a text file via a temporary sibling and rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def temp_dir_for(final: Path) -> Path:
    """An empty directory beside `final` to fill before install_dir puts it in place."""
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def install_dir(tmp: Path, final: Path) -> None:
    """Put a finished directory in place: the old one aside, the new one in, the old one gone."""
    final = Path(final)
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def replacing_dir(final: Path) -> Iterator[Path]:
    """An empty directory to fill: when the block ends it replaces `final` whole; when the block
    raises it is removed and `final` is left as it was."""
    tmp = temp_dir_for(final)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    install_dir(tmp, final)
