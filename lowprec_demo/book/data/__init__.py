"""Data for the book: Tiny Shakespeare and tokenizers (``text``), deterministic batches
(``batches``), MNIST (``mnist``), and where files come from (``environment``: the data folder,
the cache, a download, each file checked against its sha256; without them each loader falls back
to data every machine has and says so). The URLs and hashes are copies of ``text``'s and ``mnist``'s."""

from lowprec_demo.book.data.environment import (ChecksumError, DataFallbackWarning, DataUnavailableError, cache_dir,
                                                cached_per_data_environment, data_dir, download, fetch, is_offline,
                                                sha256_of)
from lowprec_demo.book.data.text import (SHAKESPEARE_SHA256, SHAKESPEARE_URL, CharTokenizer, TextCorpus, gpt2_tokens,
                                         load_shakespeare)
from lowprec_demo.book.data.batches import TokenBatches
from lowprec_demo.book.data.mnist import MNIST_SHA256, MNIST_URL, ImageDataset, load_mnist
from lowprec_demo.book.data import batches, environment, mnist, text

__all__ = environment.__all__ + text.__all__ + batches.__all__ + mnist.__all__
