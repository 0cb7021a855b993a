"""What every layer writes through: a JSON file written atomically, a file mode, a progress bar."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Iterable

__all__ = ["atomic_write_json", "default_file_mode", "progress_bar"]


def progress_bar(iterable: Iterable, desc: str = "", disable: bool = False, **kwargs):
    """A tqdm progress bar (the notebook flavour inside Jupyter), or the iterable as it is when
    disabled or without tqdm: ``for step in progress_bar(range(n), disable=not progress)``."""
    if disable:
        return _Silent(iterable)
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Silent(iterable)
    return tqdm(iterable, desc=desc, leave=False, **kwargs)


class _Silent:
    """An iterable with tqdm's ``set_postfix`` that does nothing."""

    def __init__(self, iterable: Iterable) -> None:
        self._it = iterable

    def __iter__(self):
        return iter(self._it)

    def set_postfix(self, *args, **kwargs) -> None:
        pass


def default_file_mode(fd: int) -> None:
    """Give a ``tempfile.mkstemp`` file (mode 0600) the mode ``open`` gives (0666 less the umask),
    so that a file written atomically is readable as any other."""
    mask = os.umask(0)
    os.umask(mask)
    os.fchmod(fd, 0o666 & ~mask)


def atomic_write_json(path, data: dict) -> Path:
    """Write JSON to a temp file beside ``path``, then rename it into place: no reader sees a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        default_file_mode(fd)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, allow_nan=True, separators=(",", ":"))
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
