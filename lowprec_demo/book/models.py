"""The models the book trains, a GPT (nanoGPT's layout), a small MLP and LeNet-5, each drawing its
initial weights from the ``generator`` it is given alone (every run starts from the same weights).

Example:
    >>> GPT(gpt_config("nanogpt-quick"), generator=torch.Generator().manual_seed(0)).num_params()
    809856
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "GPT_CONFIGS", "gpt_config", "MLP", "LeNet5"]


def _fill_from(tensor: torch.Tensor, draw, generator: Optional[torch.Generator]) -> None:
    """Fill ``tensor`` with ``draw(t, generator)``, drawn on the generator's device and copied when the tensor lives
    elsewhere (the same seed gives the same weights on every device); meta tensors are skipped."""
    with torch.no_grad():
        if tensor.device.type == "meta":
            return
        if generator is None or generator.device == tensor.device:
            draw(tensor, generator)
        else:
            staging = torch.empty(tensor.shape, dtype=tensor.dtype, device=generator.device)
            draw(staging, generator)
            tensor.copy_(staging)


def _pytorch_default_init_(module: nn.Module, generator: Optional[torch.Generator]) -> None:
    """PyTorch's default init of a Linear or Conv, drawn from ``generator``:
    ``kaiming_uniform_(a=sqrt(5))`` is U(-1/sqrt(fan_in), 1/sqrt(fan_in)), the bias the same."""
    bound = 1.0 / math.sqrt(module.weight[0].numel())   # fan_in: in_features, or in_channels * kernel area
    for tensor in (module.weight, module.bias):
        if tensor is not None:
            _fill_from(tensor, lambda t, g: t.uniform_(-bound, bound, generator=g), generator)


@dataclass
class GPTConfig:
    """The shape of a GPT: ``block_size`` is the longest context; ``n_embd`` must be divisible by ``n_head``."""

    block_size: int
    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t only sees positions <= t."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        # q, k and v for all heads in one matrix, as in GPT-2's checkpoints
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.c_attn(x).split(channels, dim=2)
        # (B, T, C) -> (B, n_head, T, head_size)
        q, k, v = (t.view(batch, time, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, time, channels)
        return self.resid_dropout(self.c_proj(y))


class FeedForward(nn.Module):
    """The transformer's position-wise MLP: n_embd -> 4 n_embd -> GELU -> n_embd."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2 style decoder with nanoGPT's parameter names; ``lm_head`` shares ``wte``'s weight.
    GPT-2's initialisation: weights ~ N(0, 0.02^2), the residual projections ``c_proj`` ~
    N(0, (0.02/sqrt(2 n_layer))^2), biases 0, LayerNorm weights 1, all from ``generator``."""

    def __init__(self, config: GPTConfig, generator: Optional[torch.Generator] = None) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd), wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout), h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying
        self._init_weights(generator)

    def _init_weights(self, generator: Optional[torch.Generator]) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if module is self.lm_head:
                continue  # its weight is wte's, drawn once below
            if isinstance(module, nn.LayerNorm):
                with torch.no_grad():
                    module.weight.fill_(1.0)
                    if module.bias is not None:
                        module.bias.zero_()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith("c_proj") else 0.02
                _fill_from(module.weight, lambda t, g: t.normal_(0.0, std, generator=g), generator)
                if getattr(module, "bias", None) is not None:
                    with torch.no_grad():
                        module.bias.zero_()

    def forward(self, idx: torch.Tensor,
                targets: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Logits (B, T, vocab) of ``idx``, and the mean cross-entropy against ``targets`` if given (-1: ignored)."""
        batch, time = idx.shape
        if time > self.config.block_size:
            raise ValueError(f"sequence of length {time} is longer than block_size {self.config.block_size}")
        pos = torch.arange(time, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def num_params(self, non_embedding: bool = False) -> int:
        """The parameters, ``wte``/``lm_head`` once; without the position embedding with ``non_embedding``."""
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= self.transformer.wpe.weight.numel()
        return total


GPT_CONFIGS: dict[str, GPTConfig] = {
    # GPT-2 small (124M), 50257 tokens padded to a multiple of 64 as nanoGPT does (faster on GPUs)
    "gpt2": GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768),
    # nanoGPT's character-level Shakespeare model (65 characters), without dropout
    "shakespeare-char": GPTConfig(block_size=256, vocab_size=65, n_layer=6, n_head=6, n_embd=384),
    # small enough for a few hundred steps on a laptop CPU
    "nanogpt-quick": GPTConfig(block_size=64, vocab_size=65, n_layer=4, n_head=4, n_embd=128),
}


def gpt_config(name: str, **overrides) -> GPTConfig:
    """A copy of ``GPT_CONFIGS[name]`` with fields overridden. Example: ``gpt_config("gpt2", n_layer=2)``."""
    if name not in GPT_CONFIGS:
        raise ValueError(f"unknown GPT config {name!r}; valid names: {', '.join(GPT_CONFIGS)}")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown GPTConfig field(s) {', '.join(unknown)}; valid fields: {', '.join(sorted(fields))}")
    return dataclasses.replace(GPT_CONFIGS[name], **overrides)


_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


class MLP(nn.Module):
    """Linear layers of ``sizes`` with ``activation`` between them (inputs flattened from dimension 1),
    PyTorch's default initialisation drawn from ``generator``."""

    def __init__(self, sizes: Sequence[int], activation: str = "relu",
                 generator: Optional[torch.Generator] = None) -> None:
        super().__init__()
        sizes = list(sizes)
        if len(sizes) < 2 or any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"sizes must be at least two positive integers, got {sizes!r}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; valid: {', '.join(_ACTIVATIONS)}")
        self.sizes = sizes
        self.activation = activation
        layers: list[nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            if i > 0:
                layers.append(_ACTIVATIONS[activation]())
            layers.append(nn.Linear(fan_in, fan_out))
        self.layers = nn.Sequential(*layers)
        for module in self.layers:
            if isinstance(module, nn.Linear):
                _pytorch_default_init_(module, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x.flatten(1) if x.dim() > 2 else x)


class LeNet5(nn.Module):
    """LeNet-5 for 1x28x28 images: two (5x5 conv, ReLU, 2x2 max-pool) stages, then 400-120-84-N;
    61,706 parameters for 10 classes, PyTorch's default initialisation drawn from ``generator``."""

    def __init__(self, num_classes: int = 10, generator: Optional[torch.Generator] = None) -> None:
        super().__init__()
        if not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
        self.conv1 = nn.Conv2d(1, 6, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, kernel_size=5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)
        for module in (self.conv1, self.conv2, self.fc1, self.fc2, self.fc3):
            _pytorch_default_init_(module, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))
