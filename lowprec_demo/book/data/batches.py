"""Deterministic batches of a token sequence.

Example:
    >>> batches = TokenBatches(torch.arange(10_000) % 97, block_size=64, batch_size=12, seed=0)
    >>> x, y = batches.get_batch(step=0)
    >>> x.shape, bool((y[:, :-1] == x[:, 1:]).all())
    (torch.Size([12, 64]), True)
"""

from __future__ import annotations

import hashlib
import operator
from typing import Iterable, Union

import torch

__all__ = ["TokenBatches"]


class TokenBatches:
    """Random (x, y) windows of a token sequence, the same for a (seed, split, step) whatever else a run draws: the
    first ``1 - val_fraction`` of the tokens train, the rest validate, and ``y`` is ``x`` shifted by one token."""

    SPLITS = ("train", "val")

    def __init__(self, tokens: Union[torch.Tensor, Iterable[int]], block_size: int, batch_size: int, seed: int,
                 val_fraction: float = 0.1, device: Union[str, torch.device, None] = None) -> None:
        tokens = torch.as_tensor(tokens)
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex():
            raise ValueError(f"tokens must be a 1-D integer sequence, got {tokens.dim()}-D {tokens.dtype}")
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
            raise ValueError(f"the training split has {n_train} tokens; it needs more than block_size={block_size}")
        self.block_size, self.batch_size, self.seed, self.val_fraction = block_size, batch_size, seed, val_fraction
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    def _generator(self, step: int, split: str) -> torch.Generator:
        # a hash of the whole key, so that nearby seeds and steps give unrelated streams
        key = f"TokenBatches/{self.seed}/{split}/{step}".encode()
        seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1
        return torch.Generator().manual_seed(seed)

    def get_batch(self, step: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (batch_size, block_size), on ``device``."""
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
            raise ValueError(f"the {split!r} split has {len(data)} tokens; it needs more than "
                             f"block_size={self.block_size} (val_fraction={self.val_fraction})")
        starts = torch.randint(len(data) - self.block_size, (self.batch_size,), generator=self._generator(step, split))
        windows = data[starts[:, None] + torch.arange(self.block_size + 1)]
        x, y = windows[:, :-1], windows[:, 1:]
        if self.device.type != "cpu":
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return x, y

    def __repr__(self) -> str:
        return (f"TokenBatches(train={len(self.splits['train'])} tokens, val={len(self.splits['val'])} "
                f"tokens, block_size={self.block_size}, batch_size={self.batch_size}, seed={self.seed})")
