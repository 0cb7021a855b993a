"""Running the kernels of :mod:`lowprec_demo.rounding.bits`: compiled where it pays, else eagerly.

One switch, ``LOWPREC_FUSED`` (environment) or :func:`set_mode`: ``"off"`` never compiles, ``"on"`` compiles every
kernel for tensors of 2 or more elements, ``"auto"`` (default) compiles a kernel once its eager work, this call
included, reaches :data:`EAGER_BUDGET` elements. Compiling costs seconds once per process and variant (device type,
options, argument dtypes), the eager functions (in cache-sized slices of :data:`EAGER_CHUNK`) a few nanoseconds an
element more (``benchmarks/README.md``): a chapter that rounds a few tensors need not wait for the compiler, a large
model compiles at once. If compiling fails, the function runs eagerly from then on and :func:`status` says why. The
entry points take a format and make the kernels' integer parameters once per format and device.

Example:
    >>> import torch
    >>> from lowprec_demo.formats import get_format
    >>> nearest(torch.tensor([1.06, 500.0]), get_format("e4m3"), "saturate").tolist()
    [1.0, 448.0]
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from typing import Callable, Dict, Optional

import torch

from lowprec_demo.rounding import bits
from lowprec_demo.formats import FloatFormat
from lowprec_demo.rounding.rule import LAYOUTS, RoundParams, bin_thresholds, gap_options, round_params, rule_params

__all__ = ["MODES", "EAGER_BUDGET", "EAGER_CHUNK", "MAX_NUMEL", "set_mode", "get_mode", "status", "reset",
           "compile_all", "nearest", "stochastic", "freeze_detail", "step_code", "equal_count", "changed_blocks", "fits",
           "BLOCK"]

MODES = ("auto", "on", "off")
EAGER_BUDGET = 1 << 27         # "auto": compile once a kernel's eager work would reach this many elements
MIN_NUMEL = 2                  # torch.compile specialises sizes 0 and 1: keep those eager
MAX_NUMEL = bits.MAX_NUMEL     # larger tensors run eagerly, slice by slice (the same bits)
BLOCK = bits.BLOCK
EAGER_CHUNK = 1 << 18          # eagerly, tensors go in slices this long (the fastest of 2**16 .. 2**19 measured)

_INDEX_SLOT = RoundParams._fields.index("index_offset")


# --- running a kernel: compiled when asked or when the work pays for it, else the same function eagerly ---
@functools.cache
def _keep_freed_memory() -> None:
    """Let the C allocator keep the slices' freed temporaries, once per process: glibc's malloc
    returns freed memory above a threshold to the system (the next slice then page-faults on
    it), and mapping and freeing one 16 MB block raises that threshold to 32 MB."""
    torch.empty(1 << 22, dtype=torch.int32)


def advance_index(p: torch.Tensor, start: int) -> torch.Tensor:
    """The rounding parameters ``p`` of a slice that starts ``start`` elements in: its
    ``index_offset`` moved on by ``start`` (modulo 2**32, as the hash reads it)."""
    p = p.clone()
    p[_INDEX_SLOT] = (p[_INDEX_SLOT].to(torch.int64) + (start + (1 << 31))) % (1 << 32) - (1 << 31)
    return p


def _sliced(fn, args: tuple, advance: Optional[Callable] = None, options: Optional[dict] = None):
    """``fn(*args, **options)`` run eagerly slice by slice (the tensors as long as the first
    argument sliced alike; the parameter tensor, last, by ``advance``): results as long as the
    slice go into one output while in the cache, others are concatenated or (0-dim) summed."""
    n = args[0].numel()
    options = options or {}
    if n <= EAGER_CHUNK:
        return fn(*args, **options)
    _keep_freed_memory()
    outs, pieces, single = None, None, False
    for start in range(0, n, EAGER_CHUNK):
        sliced = [a[start:start + EAGER_CHUNK] if torch.is_tensor(a) and a.dim() and a.numel() == n else a
                  for a in args]
        if advance is not None:
            sliced[-1] = advance(sliced[-1], start)
        part = fn(*sliced, **options)
        if part is None:
            continue
        single = not isinstance(part, tuple)
        part = (part,) if single else part
        length = sliced[0].numel()
        if outs is None:
            outs = [torch.empty(n, dtype=t.dtype, device=t.device) if t.dim() and t.numel() == length
                    else None for t in part]
            pieces = [[] for _ in part]
        for i, t in enumerate(part):
            if outs[i] is not None:
                outs[i][start:start + length].copy_(t)
            else:
                pieces[i].append(t)
    if outs is None:
        return None
    joined = [o if o is not None else (sum(ps) if ps[0].dim() == 0 else torch.cat(ps)) for o, ps in zip(outs, pieces)]
    return joined[0] if single else tuple(joined)


class _Kernel:
    """A kernel function with its compiled versions (per device type), the first compiled call's
    time and the eager work per variant, the calls each way and why compiling failed, if it did;
    ``advance`` makes a slice's parameter tensor (the last argument, :func:`advance_index`)."""

    def __init__(self, fn, name: str, advance: Optional[Callable] = None) -> None:
        self.fn, self.name, self.advance = fn, name, advance
        self.compiled: Dict[str, object] = {}
        self.variants: Dict[tuple, float] = {}   # (device type, options, dtypes): seconds of the first compiled call
        self.failed: Dict[str, str] = {}
        self.eager_numel: Dict[tuple, int] = {}
        self.calls = {"compiled": 0, "eager": 0}

    def __call__(self, *args, eager=None, **options):
        """Compiled when the mode says so, else ``eager()`` (by default the function itself)."""
        n, device = args[0].numel(), args[0].device.type
        # what torch.compile makes a version for: the options and the arguments' dtypes
        variant = (device, tuple(options.items()), tuple(getattr(a, "dtype", a) for a in args))
        mode = _state["mode"]
        if (mode != "off" and MIN_NUMEL <= n <= MAX_NUMEL and device not in self.failed
                and (mode == "on" or variant in self.variants or self.eager_numel.get(variant, 0) + n > EAGER_BUDGET)):
            try:
                start = time.perf_counter()
                with torch.no_grad():   # one grad mode: no recompiling for callers with grad on
                    out = self.compiled_call(device)(*args, **options)
                if variant not in self.variants:
                    self.variants[variant] = time.perf_counter() - start
                self.calls["compiled"] += 1
                return out
            except Exception as error:  # no compiler, unsupported platform...: eagerly from now on
                lines = str(error).strip().splitlines()
                self.failed[device] = f"{type(error).__name__}: {lines[0][:300] if lines else ''}"
                self.compiled.pop(device, None)
                warnings.warn(f"compiling the {self.name} kernel for {device} failed ({self.failed[device]}); it runs "
                              "eagerly from now on in this process, with the same bits, only slower "
                              "(lowprec_demo.rounding.kernels.status() shows what failed)", RuntimeWarning, stacklevel=3)
        self.eager_numel[variant] = self.eager_numel.get(variant, 0) + n
        self.calls["eager"] += 1
        return _sliced(self.fn, args, self.advance, options) if eager is None else eager()

    def compiled_call(self, device_type: str):
        """The compiled function for the device type, made (not yet compiled) on first use."""
        fn = self.compiled.get(device_type)
        if fn is None:
            fn = self.compiled[device_type] = torch.compile(self.fn, dynamic=True, fullgraph=True)
        return fn

    def compile_seconds(self) -> Dict[str, float]:
        """Per device type, the time the first compiled call of every setting took, summed."""
        seconds: Dict[str, float] = {}
        for (device, _, _), t in self.variants.items():
            seconds[device] = seconds.get(device, 0.0) + t
        return seconds


def _env_mode() -> str:
    mode = os.environ.get("LOWPREC_FUSED", "auto").strip().lower()
    return {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}.get(
        mode, mode if mode in MODES else "auto")


_state = {"mode": _env_mode()}
_KERNELS = {
    # the rounding kernels take and give bit patterns (:mod:`lowprec_demo.rounding.bits`)
    "nearest": _Kernel(bits.rne_bits, "nearest"),
    "nearest_": _Kernel(bits.rne_bits_, "nearest_"),
    "stochastic": _Kernel(bits.sr_bits, "stochastic", advance_index),
    "stochastic_": _Kernel(bits.sr_bits_, "stochastic_", advance_index),
    # called without grad, so that a caller's grad mode does not double the compiled variants
    "step_code": _Kernel(bits.step_code_fp32, "step_code"),
    "freeze_detail": _Kernel(bits.freeze_detail_fp32, "freeze_detail"),
    "equal_count": _Kernel(bits.equal_count_fp32, "equal_count"),
    "changed_blocks": _Kernel(bits.changed_blocks_fp32, "changed_blocks"),
}


def set_mode(mode: str) -> str:
    """Choose when compiled kernels are used: ``"auto"``, ``"on"`` or ``"off"``; returns the previous mode.

    Example:
        >>> previous = set_mode("off"); set_mode(previous)
        'off'
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    previous, _state["mode"] = _state["mode"], mode
    return previous


def get_mode() -> str:
    """The current mode (see :func:`set_mode`)."""
    return _state["mode"]


def status() -> dict:
    """Which kernels are compiled (per device type), how long their first calls took, how many
    calls ran each way, and why compilation failed, if it did."""
    return {"mode": _state["mode"], "torch": torch.__version__,
            "kernels": {name: {"compiled": sorted(k.compile_seconds()), "compile_seconds": k.compile_seconds(),
                               "variants": len(k.variants), "failed": dict(k.failed), "calls": dict(k.calls)}
                        for name, k in _KERNELS.items()}}


def reset() -> None:
    """Forget compiled kernels, failures and eager work (for tests and benchmarks)."""
    for name, k in list(_KERNELS.items()):
        _KERNELS[name] = _Kernel(k.fn, name, k.advance)


# --- entry points for the rounding functions, the optimizer, the predictor and the watch -----------
_PARAM_CACHE: Dict[tuple, torch.Tensor] = {}


def _cached_params(kind: str, fmt: FloatFormat, overflow: Optional[str], rand_bits: Optional[int],
                   device: torch.device, dtype=torch.float32) -> torch.Tensor:
    """The parameter tensor of a format for round to nearest or the rule, made once per device."""
    key = (kind, fmt, overflow, rand_bits, device, dtype)
    t = _PARAM_CACHE.get(key)
    if t is None:
        layout = LAYOUTS[dtype]
        values = (round_params(fmt, overflow, layout=layout) if kind == "nearest"
                  else rule_params(fmt, rand_bits, layout, overflow))
        if len(_PARAM_CACHE) > 256:
            _PARAM_CACHE.clear()
        t = _PARAM_CACHE[key] = values.tensor(device, layout)
    return t


def nearest(x: torch.Tensor, fmt: FloatFormat, overflow: Optional[str] = None, eager=None,
            inplace: bool = False) -> torch.Tensor:
    """RNE of a float32 or float64 tensor with the overflow policy ``overflow`` (None: the format's own): a new tensor
    (``x`` any shape and layout) or, with ``inplace``, written over ``x`` (contiguous). Compiled, or ``eager()`` where
    given (a result of x's dtype, in place when asked), else the kernel function run eagerly."""
    p = _cached_params("nearest", fmt, overflow, None, x.device, dtype=x.dtype)
    itype = LAYOUTS[x.dtype].itype
    if inplace:
        _KERNELS["nearest_"](x.view(-1).view(itype), p, eager=eager)
        return x
    out = _KERNELS["nearest"](x.reshape(-1).view(itype), p,
                              eager=None if eager is None else lambda: eager().view(itype)).view(x.dtype)
    return out if out.shape == x.shape else out.view(x.shape)


def stochastic(x: torch.Tensor, fmt: FloatFormat, overflow: Optional[str], rand_bits: Optional[int], seed: int,
               index_offset: int = 0, inplace: bool = False) -> torch.Tensor:
    """SR of a float32 or float64 tensor as a new tensor, or with ``inplace`` written over ``x``
    (contiguous); element i of ``x`` in row-major order draws the hash of (seed, index_offset + i)."""
    layout = LAYOUTS[x.dtype]
    p = round_params(fmt, overflow, rand_bits, seed, index_offset, layout).tensor(x.device, layout)
    if inplace:
        _KERNELS["stochastic_"](x.view(-1).view(layout.itype), p)
        return x
    return _KERNELS["stochastic"](x.reshape(-1).view(layout.itype), p).view(x.dtype).view(x.shape)


def equal_count(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _KERNELS["equal_count"](a, b)         # bits.equal_count_fp32, compiled or eagerly


def changed_blocks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _KERNELS["changed_blocks"](a, b)


def step_code(old: torch.Tensor, new: torch.Tensor, grad: Optional[torch.Tensor], tensor_id: torch.Tensor,
              log_lr: Optional[torch.Tensor], fmt: FloatFormat, rand_bits: Optional[int] = None, moves_sum: bool = False,
              octaves: bool = False):
    """The codes (``rule.step_code``) and move probabilities (resolved to ``rand_bits``, None: full; with
    ``moves_sum`` their float64 sum) of the update ``new - old`` at ``q(old)`` of flat float32 tensors
    (:func:`lowprec_demo.rounding.bits.step_code_fp32`); ``grad`` the gradients or None (no flag), ``tensor_id`` int32
    per element or 0-dim, ``log_lr`` float32 per tensor, 0-dim (one for all) or None (no shift); ``octaves``: whole
    octaves, no shift and no flag."""
    p = _cached_params("freeze", fmt, None, rand_bits, old.device)
    if octaves and (grad is not None or log_lr is not None):
        raise ValueError("whole-octave codes take neither a gradient flag nor a learning-rate shift")
    bins = None if octaves else bin_thresholds(log_lr, old.device)
    return _KERNELS["step_code"](old, new, grad, tensor_id, bins, p, moves_sum=moves_sum)


def freeze_detail(old: torch.Tensor, new: torch.Tensor, fmt: FloatFormat, overflow: Optional[str] = None):
    """``(frozen, ratio, stuck)`` of the rule (:func:`lowprec_demo.rounding.rule.freeze_elements`) per element of two
    flat float32 tensors, for the update ``new - old`` at ``q(old)``, with ``overflow`` (None: the format's policy)."""
    p = _cached_params("freeze", fmt, overflow, None, old.device)
    return _KERNELS["freeze_detail"](old, new, p, **gap_options(fmt))


def compile_all(device="cpu") -> dict:
    """Compile every kernel for ``device`` now and return :func:`status` (first calls timed)."""
    previous = set_mode("on")
    try:
        x = torch.randn(4096, device=device)
        fmt = FloatFormat(5, 3)
        nearest(x, fmt, "inf")
        nearest(x.clone(), fmt, "inf", inplace=True)
        stochastic(x, fmt, "inf", None, 1)
        stochastic(x.clone(), fmt, "inf", None, 1, inplace=True)
        zero = torch.zeros((), device=device)
        ids = torch.arange(4096, dtype=torch.int32, device=device) % 2
        # the four variants: the predictor's (one tensor, or a pack of several), the watch's (one learning rate, or
        # one per tensor: two or more, as step_code passes them)
        step_code(x, x + 1e-3, None, zero.to(torch.int32), None, fmt, moves_sum=True, octaves=True)
        step_code(x, x + 1e-3, None, ids, None, fmt, moves_sum=True, octaves=True)
        grad = torch.randn_like(x)     # (not x itself: an argument passed twice compiles a version of its own)
        step_code(x, x + 1e-3, grad, ids, zero, fmt)
        step_code(x, x + 1e-3, grad, ids, torch.zeros(2, device=device), fmt)
        freeze_detail(x, x + 1e-3, fmt)
        equal_count(x, x + 1e-3)
        changed_blocks(x, x + 1e-3)
        if x.device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        set_mode(previous)
    return status()


def fits(x: torch.Tensor, fmt: FloatFormat) -> bool:
    """Whether the freeze kernels handle this tensor and format: float32 values, a format float32 holds."""
    return x.dtype == torch.float32 and fmt.e_max + 1 <= 128
