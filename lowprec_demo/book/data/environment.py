"""Where a loader's files come from: ``$LOWPREC_DATA_DIR``, the download cache, else a download unless
``LOWPREC_OFFLINE`` is set (:func:`fetch`, sha256-checked). A loader without its file falls back to data every machine
has, warning with a :class:`DataFallbackWarning`, printed without file and line so stored outputs match everywhere."""

from __future__ import annotations

import functools
import hashlib
import http.client
import os
import tempfile
import threading
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from typing import Optional, Union

from lowprec_demo.common.output import default_file_mode

__all__ = ["ChecksumError", "DataUnavailableError", "DataFallbackWarning", "data_dir", "cache_dir", "is_offline",
           "cached_per_data_environment", "sha256_of", "download", "fetch"]

PathLike = Union[str, os.PathLike]


class ChecksumError(ValueError):
    """A file's sha256 is not the expected one."""


class DataUnavailableError(RuntimeError):
    """A file could not be found locally nor downloaded (offline, or the network failed)."""


class DataFallbackWarning(UserWarning):
    """A loader uses its offline stand-in, not the requested data, or ``LOWPREC_DATA_DIR`` points at nothing usable."""


def _install_warning_format() -> None:
    """Print a DataFallbackWarning as ``DataFallbackWarning: message``; every other warning as
    before. Installed once, on import; catching warnings is unaffected."""
    previous = warnings.formatwarning
    if getattr(previous, "_lowprec_demo", False):
        return
    module_globals = globals()

    def formatwarning(message, category, filename, lineno, line=None):
        # looked up at call time, so that a reloaded module's class is the one recognized
        fallback = module_globals.get("DataFallbackWarning")
        if isinstance(category, type) and fallback is not None and issubclass(category, fallback):
            return f"{category.__name__}: {message}\n"
        return previous(message, category, filename, lineno, line)

    formatwarning._lowprec_demo = True  # type: ignore[attr-defined]
    warnings.formatwarning = formatwarning


_install_warning_format()

# The files a data folder may hold, named for data_dir's check; data.text and data.mnist take their names from here.
SHAKESPEARE_FILENAME = "tinyshakespeare.txt"
MNIST_FILENAME = "mnist.npz"
DATA_FILES = (SHAKESPEARE_FILENAME, MNIST_FILENAME)

# LOWPREC_DATA_DIR values resolved so far in this process, value -> absolute folder.
_resolved_data_dirs: dict[str, Path] = {}
_resolved_lock = threading.Lock()


def _checkout_root() -> Optional[Path]:
    """The repository root when the package runs from a checkout (``pip install -e .``), else None."""
    root = Path(__file__).resolve().parents[3]   # <root>/lowprec_demo/book/data/environment.py
    return root if (root / "pyproject.toml").is_file() and (root / "lowprec_demo").is_dir() else None


def _resolve_data_dir(value: str) -> Path:
    path = Path(value).expanduser()
    if path.is_absolute():
        candidates = [path]
    else:
        candidates = [Path.cwd() / path]
        root = _checkout_root()
        if root is not None and root / path != candidates[0]:
            candidates.append(root / path)
    candidates = [Path(os.path.normpath(c)) for c in candidates]
    found = next((c for c in candidates if c.is_dir()), None)
    if found is None:
        where = " nor ".join(str(c) for c in candidates)
        warnings.warn(f"LOWPREC_DATA_DIR={value!r} is not a folder (there is no {where}); the loaders use "
                      f"the cache, a download, or their offline fallback", DataFallbackWarning, stacklevel=4)
        return candidates[0]
    if not any((found / name).is_file() for name in DATA_FILES):
        shown = f"{value!r}" if str(found) == value else f"{value!r} ({found})"
        warnings.warn(f"LOWPREC_DATA_DIR={shown} holds none of the files the loaders look for "
                      f"({', '.join(DATA_FILES)}); they use the cache, a download, or their offline fallback",
                      DataFallbackWarning, stacklevel=4)
    return found


def data_dir() -> Optional[Path]:
    """``$LOWPREC_DATA_DIR`` as an absolute path (None when unset). A relative value is resolved once
    per process, against the current folder, else the checkout's root (so it holds in ``book/``
    too); warns when the folder is missing or holds none of the data files."""
    value = os.environ.get("LOWPREC_DATA_DIR", "")
    if not value:
        return None
    with _resolved_lock:
        if value not in _resolved_data_dirs:
            _resolved_data_dirs[value] = _resolve_data_dir(value)
        return _resolved_data_dirs[value]


def cache_dir() -> Path:
    """The download cache, ``$LOWPREC_CACHE_DIR`` or ``~/.cache/lowprec_demo``."""
    value = os.environ.get("LOWPREC_CACHE_DIR", "")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "lowprec_demo"


def is_offline() -> bool:
    """True when ``LOWPREC_OFFLINE`` is set to anything but "", "0", "false" or "no"."""
    return os.environ.get("LOWPREC_OFFLINE", "").strip().lower() not in ("", "0", "false", "no")


def _data_environment() -> tuple[str, str, bool]:
    """What decides where a loader's data comes from: the data folder, the cache, offline or not."""
    local = data_dir()
    return (str(local) if local is not None else "", str(cache_dir()), is_offline())


def cached_per_data_environment(maxsize: int = 4):
    """Decorator: remember what a loader returned per data environment and arguments, so that many runs
    read a file once, and repeat on every call the warnings the first gave. ``.cache_clear()``."""
    def decorate(loader):
        @functools.lru_cache(maxsize=maxsize)
        def load(environment, args, kwargs):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                value = loader(*args, **dict(kwargs))
            return value, tuple(w.message for w in caught)

        @functools.wraps(loader)
        def cached(*args, **kwargs):
            value, messages = load(_data_environment(), args, tuple(sorted(kwargs.items())))
            for message in messages:
                warnings.warn(message, stacklevel=2)
            return value

        cached.cache_clear = load.cache_clear
        cached.cache_info = load.cache_info
        return cached
    return decorate


def sha256_of(path: PathLike) -> str:
    """Hex sha256 digest of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download(url: str, dest: PathLike, sha256: str, timeout: float = 30) -> Path:
    """Download ``url`` to ``dest`` if and only if its bytes have the given sha256 (a temporary file
    renamed into place: ``dest`` is absent, unchanged or complete); network URLs are refused
    offline. Raises :class:`ChecksumError` or :class:`DataUnavailableError`."""
    dest = Path(dest)
    if is_offline() and not url.startswith("file:"):
        raise DataUnavailableError(f"LOWPREC_OFFLINE is set: not downloading {url}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    digest = hashlib.sha256()
    try:
        default_file_mode(fd)
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(url, timeout=timeout) as response:
                    for chunk in iter(lambda: response.read(1 << 20), b""):
                        digest.update(chunk)
                        out.write(chunk)
            except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
                raise DataUnavailableError(f"could not download {url}: {exc}") from exc
            out.flush()
            os.fsync(out.fileno())
        actual = digest.hexdigest()
        if actual != sha256.lower():
            raise ChecksumError(f"sha256 mismatch for {url}: expected {sha256.lower()}, got {actual}; "
                                f"the download was discarded and {dest} was not written")
        os.replace(tmp_name, dest)
    except BaseException:
        try:
            os.remove(tmp_name)
        except FileNotFoundError:
            pass
        raise
    return dest


def fetch(filename: str, url: str, sha256: str, timeout: float = 30) -> tuple[Path, str]:
    """A verified copy of ``filename`` from :func:`data_dir`, :func:`cache_dir` or a download, and
    where it came from by kind of place, not path. A wrong copy in the data folder is an error; a
    wrong cache copy is fetched again; :class:`DataUnavailableError` when there is none."""
    local_dir = data_dir()
    if local_dir is not None:
        local = local_dir / filename
        if local.is_file():
            actual = sha256_of(local)
            if actual != sha256:
                raise ChecksumError(f"{local} (from LOWPREC_DATA_DIR) has sha256 {actual}, expected {sha256}; "
                                    f"replace it with a good copy of {url} or unset LOWPREC_DATA_DIR")
            return local, f"{filename} from the local data folder, sha256 verified"

    cached = cache_dir() / filename
    if cached.is_file():
        actual = sha256_of(cached)
        if actual == sha256:
            return cached, f"{filename} from the download cache, sha256 verified"
        warnings.warn(f"deleting the corrupt copy of {filename} in the download cache "
                      f"(sha256 {actual}, expected {sha256})", DataFallbackWarning, stacklevel=2)
        cached.unlink()

    download(url, cached, sha256, timeout=timeout)
    return cached, f"{filename} downloaded from {url} into the download cache, sha256 verified"
