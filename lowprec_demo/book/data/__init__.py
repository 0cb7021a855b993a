"""Data for the book: Tiny Shakespeare, tokenizers, deterministic batches and MNIST.

Modules: ``environment`` (where files come from, their sha256 checks, the errors and the
fallback warning, the per-environment cache of loaded data), ``text`` (Tiny Shakespeare and its
stand-in, the character and GPT-2 tokenizers), ``batches`` (``TokenBatches``) and ``mnist``
(``load_mnist``). Every name below is importable from here (``from lowprec_demo.data import
load_shakespeare``). The URLs and hashes here are copies: to change one (a test that serves its
own file), change it in the module that reads it, ``text`` or ``mnist``.

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

from lowprec_demo.book.data.environment import (ChecksumError, DataFallbackWarning, DataUnavailableError, cache_dir, cached_per_data_environment, data_dir, download, fetch, is_offline, sha256_of)
from lowprec_demo.book.data.text import (SHAKESPEARE_SHA256, SHAKESPEARE_URL, CharTokenizer, TextCorpus, gpt2_tokens, load_shakespeare)
from lowprec_demo.book.data.batches import TokenBatches
from lowprec_demo.book.data.mnist import MNIST_SHA256, MNIST_URL, ImageDataset, load_mnist
from lowprec_demo.book.data import batches, environment, mnist, text

__all__ = environment.__all__ + text.__all__ + batches.__all__ + mnist.__all__
