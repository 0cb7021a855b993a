"""Text for the language experiments: Tiny Shakespeare (or its offline stand-in, the Python
standard library's own sources), the character tokenizer and GPT-2's BPE (or UTF-8 bytes).

Example:
    >>> CharTokenizer("hello").vocab_size
    4
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch

from lowprec_demo.book.data.environment import (SHAKESPEARE_FILENAME, DataFallbackWarning, DataUnavailableError,
                                                PathLike, fetch, is_offline)

__all__ = ["SHAKESPEARE_URL", "SHAKESPEARE_SHA256", "TextCorpus", "load_shakespeare", "CharTokenizer", "gpt2_tokens"]

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"

FALLBACK_CORPUS_CHARS = 1_000_000


@dataclass
class TextCorpus:
    """A text and where it came from (``fallback`` is True for the offline stand-in)."""

    text: str
    source: str
    fallback: bool = False


def _stdlib_corpus(max_chars: int = FALLBACK_CORPUS_CHARS, stdlib: Optional[PathLike] = None) -> tuple[str, str]:
    """The top-level ``.py`` files of ``stdlib`` (default: this Python's standard library) in
    sorted order, up to about ``max_chars``, and a sentence naming them (not by their path)."""
    stdlib = Path(stdlib if stdlib is not None else sysconfig.get_paths().get("stdlib") or Path(os.__file__).parent)
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise DataUnavailableError(f"no Python sources found in {stdlib} for the fallback corpus")
    parts: list[str] = []
    for path in files:
        parts.append(f"# ---- {path.name} ----\n" + path.read_text(encoding="utf-8", errors="replace"))
        if sum(map(len, parts)) >= max_chars:
            break
    text = "".join(parts)
    version = ".".join(map(str, sys.version_info[:3]))
    source = (f"fallback corpus: the first {len(parts)} .py files, in sorted order, of the Python "
              f"{version} standard library ({files[0].name} to {files[len(parts) - 1].name}, "
              f"{len(text):,} characters)")
    return text, source


def load_shakespeare() -> TextCorpus:
    """Tiny Shakespeare (1,115,394 characters, sha256 verified), or with a warning about 1 MB of the
    Python standard library's sources, which every machine has (``fallback`` True)."""
    try:
        path, source = fetch(SHAKESPEARE_FILENAME, SHAKESPEARE_URL, SHAKESPEARE_SHA256)
    except DataUnavailableError as exc:
        text, source = _stdlib_corpus()
        warnings.warn(f"Tiny Shakespeare is unavailable ({exc}); using the {source}", DataFallbackWarning,
                      stacklevel=2)
        return TextCorpus(text=text, source=source, fallback=True)
    return TextCorpus(text=path.read_text(encoding="utf-8"), source=source)


class CharTokenizer:
    """Character-level tokenizer: token i is the i-th of the text's distinct characters, sorted.

    Example:
        >>> tok = CharTokenizer("hello"); tok.encode("hell"), tok.decode([1, 0])
        ([1, 0, 2, 2], 'he')
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


# A tiktoken download that never answered keeps tiktoken's registry lock: remember it, so later calls fall back at once.
_gpt2_stuck: Optional[threading.Thread] = None

_GPT2_FILES = ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
               "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json")


def _tiktoken_gpt2_cached() -> bool:
    """Whether tiktoken's file cache holds the GPT-2 BPE files (same lookup as tiktoken's)."""
    folder = os.environ.get("TIKTOKEN_CACHE_DIR",
                            os.environ.get("DATA_GYM_CACHE_DIR", os.path.join(tempfile.gettempdir(), "data-gym-cache")))
    if not folder:
        return False
    return all(os.path.isfile(os.path.join(folder, hashlib.sha1(url.encode()).hexdigest())) for url in _GPT2_FILES)


def _gpt2_encoding(timeout: float):
    """tiktoken's "gpt2" encoding and "", or None and the reason it is unavailable."""
    global _gpt2_stuck
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed"
    if is_offline() and not _tiktoken_gpt2_cached():
        return None, "running offline, and tiktoken's cache has no GPT-2 files"
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
    return (result["encoding"], "") if "encoding" in result else (None, result.get("error", "unknown error"))


def gpt2_tokens(text: str, timeout: float = 30) -> tuple[torch.Tensor, int, str]:
    """``text`` as GPT-2 BPE tokens (tiktoken's "gpt2": a download the first time, or its cache),
    or as UTF-8 bytes when that is unavailable: ``(tokens, vocab_size, description)``, a 1-D
    LongTensor, 50257 or 256, and a sentence saying which was used and why."""
    encoding, reason = _gpt2_encoding(timeout)
    if encoding is not None:
        ids = encoding.encode_ordinary(text)
        return (torch.tensor(ids, dtype=torch.long), encoding.n_vocab,
                f"GPT-2 BPE tokens (tiktoken 'gpt2', vocab {encoding.n_vocab})")
    tokens = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    return tokens, 256, f"UTF-8 byte tokens (vocab 256), because GPT-2 BPE is unavailable: {reason}"
