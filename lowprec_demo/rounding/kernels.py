"""Running the kernels of :mod:`lowprec_demo.bit_kernels`: compiled where it pays, else eagerly.

One switch: ``LOWPREC_FUSED`` (environment) or :func:`set_mode`: ``"off"`` never compiles, ``"on"``
compiles every kernel for tensors of 2 or more elements, ``"auto"`` (default) compiles a kernel
once its eager work, this call included, reaches :data:`EAGER_BUDGET` elements (a single call that
large compiles at once). Each kernel is compiled once per process and device type where it is
first called (``torch.compile(fullgraph=True, dynamic=True)``: one version per setting of its
Python options and per dtypes of its arguments); if compiling fails (no C++ compiler, an
unsupported platform), the same function runs eagerly from then on and :func:`status` says why.
The results are the same bits in every mode.

Compiling every kernel costs 6-13 s once per process on the CPUs of the stored benchmarks (the
lower figure once inductor's disk cache is warm), and up to 90 s on the slowest of them with that
cache empty. The eager functions, run in slices of :data:`EAGER_CHUNK` elements while the slice is
in the cache, cost about 10 (round to nearest) to 20 (stochastic rounding) ns an element more than
the compiled ones on the faster CPUs, 17 and 34 on the slowest (``benchmarks/README.md``), so
compiling pays after about 2**28 to 2**31 elements; the budget leans toward compiling early: a
chapter that rounds a few tensors never waits for it, a GPT-2 step compiles at once.

The entry points (:func:`nearest`, :func:`stochastic`, :func:`freeze_code`, :func:`watch_code`,
...) take a format and make the kernels' integer parameters once per format and device.

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
from typing import Dict, Optional, Sequence

import torch

from lowprec_demo.rounding import bits
from lowprec_demo.formats import FloatFormat
from lowprec_demo.rounding.rule import RATIO_EDGES, gap_options, rule_params

__all__ = ["MODES", "EAGER_BUDGET", "EAGER_CHUNK", "MAX_NUMEL", "set_mode", "get_mode", "status", "reset",
           "compile_all", "nearest", "nearest_", "stochastic", "stochastic_", "freeze_code", "freeze_detail",
           "watch_code", "equal_count", "changed_blocks", "frozen_blocks", "fits", "CODE_LAYOUTS", "BLOCK"]

MODES = ("auto", "on", "off")
EAGER_BUDGET = 1 << 27         # "auto": compile once a kernel's eager work would reach this many elements
MIN_NUMEL = 2                  # torch.compile specialises sizes 0 and 1: keep those eager
MAX_NUMEL = bits.MAX_NUMEL      # int32 element indices: larger tensors take the eager float64-style path
BLOCK = bits.BLOCK

# ------------------------------------------------------------------------------------------------
# running a kernel: compiled when asked or when the work pays for it, else the same function eagerly
# ------------------------------------------------------------------------------------------------
EAGER_CHUNK = 1 << 18   # eagerly, tensors go in slices this long (the fastest of 2**16 .. 2**19 here)


@functools.cache
def _keep_freed_memory() -> None:
    """Let the C allocator keep the slices' freed temporaries, once per process. glibc's malloc
    gives memory freed at the top of its heap back to the system once there is more of it than
    a threshold (128 KB at first, then twice the largest block it mapped on its own and has
    freed), so that the next slice takes a page fault for every 4 KB of it that it writes (a
    third of the eager time here). Mapping and freeing one 16 MB block raises the threshold to
    32 MB, as in any process that has freed a tensor of that size; other allocators ignore it."""
    block = torch.empty(1 << 22, dtype=torch.int32)
    del block


def _sliced(fn, args: tuple, first: Optional[int] = None, options: Optional[dict] = None):
    """``fn(*args, **options)`` run eagerly slice by slice: every tensor argument as long as the
    first one sliced alike, the others whole; with ``first``, the parameter tensor (the last
    argument) told at that position where each slice starts. Each returned tensor as long as
    its slice goes straight into one output tensor (while the slice is still in the cache),
    others are concatenated and 0-dim ones (sums) added in slice order: the bits of one call."""
    n = args[0].numel()
    options = options or {}
    if n <= EAGER_CHUNK:
        return fn(*args, **options)
    _keep_freed_memory()
    outs, pieces, single = None, None, False
    for start in range(0, n, EAGER_CHUNK):
        sliced = [a[start:start + EAGER_CHUNK] if torch.is_tensor(a) and a.dim() and a.numel() == n else a
                  for a in args]
        if first is not None:
            sliced[-1] = sliced[-1].clone()
            sliced[-1][first] += start
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
    """A kernel function with its compiled versions (``torch.compile``, one per device type,
    which makes one version per setting of the keyword options a call passes and per dtypes of
    its arguments: a variant), the time the first compiled call of each variant took, the calls
    that ran each way and why compiling failed, if it did. In mode ``"auto"`` each variant
    counts its own eager work. ``first``: where its parameters hold the index of the first
    element."""

    def __init__(self, fn, name: str, first: Optional[int] = None) -> None:
        self.fn, self.name, self.first = fn, name, first
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
        if (mode != "off" and n >= MIN_NUMEL and device not in self.failed
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
        self.eager_numel[variant] = self.eager_numel.get(variant, 0) + n
        self.calls["eager"] += 1
        return _sliced(self.fn, args, self.first, options) if eager is None else eager()

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
    # the rounding kernels take and give bit patterns (see "Bit patterns in and out" above)
    "nearest": _Kernel(bits.rne_bits, "nearest"),
    "nearest_": _Kernel(bits.rne_bits_, "nearest_"),
    "stochastic": _Kernel(bits.sr_bits, "stochastic", first=8),
    "stochastic_": _Kernel(bits.sr_bits_, "stochastic_", first=8),
    # five variants (see freeze_code): torch.compile keeps at most eight versions of a function
    # (torch._dynamo.config.recompile_limit), and the kernels are called without grad, so that
    # a caller's grad mode does not double them
    "freeze": _Kernel(bits.freeze_code_fp32, "freeze"),
    "watch_code": _Kernel(bits.watch_code_fp32, "watch_code"),
    "freeze_detail": _Kernel(bits.freeze_detail_fp32, "freeze_detail"),
    "equal_count": _Kernel(bits.equal_count_fp32, "equal_count"),
    "changed_blocks": _Kernel(bits.changed_blocks_fp32, "changed_blocks"),
    "frozen_blocks": _Kernel(bits.frozen_blocks_u8, "frozen_blocks"),
}


def set_mode(mode: str) -> str:
    """Choose when compiled kernels are used: ``"auto"``, ``"on"`` or ``"off"``; returns the
    previous mode. The results are the same bits in every mode.

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
    """Which kernels are compiled (per device type), how long their first call took, how many
    calls ran compiled and eagerly, and why compilation failed, if it did.

    Example: ``status()["mode"]`` -> ``"auto"``."""
    return {"mode": _state["mode"], "torch": torch.__version__,
            "kernels": {name: {"compiled": sorted(k.compile_seconds()), "compile_seconds": k.compile_seconds(),
                               "variants": len(k.variants), "failed": dict(k.failed), "calls": dict(k.calls)}
                        for name, k in _KERNELS.items()}}


def reset() -> None:
    """Forget compiled kernels, failures and eager work (for tests and benchmarks)."""
    for name, k in list(_KERNELS.items()):
        _KERNELS[name] = _Kernel(k.fn, name, k.first)


# ------------------------------------------------------------------------------------------------
# entry points for rounding.py, optimizer.py and prediction.py
# ------------------------------------------------------------------------------------------------
_PARAM_CACHE: Dict[tuple, torch.Tensor] = {}


def _cached_params(kind: str, fmt: FloatFormat, policy: Optional[str], rand_bits: Optional[int],
                   device: torch.device, edges: Sequence[int] = RATIO_EDGES) -> torch.Tensor:
    """The parameter tensor of a format (no seed), made once per device: round to nearest with
    the overflow ``policy``, or the freeze rule (``policy`` None: the format's own)."""
    key = (kind, fmt, policy, rand_bits, device, tuple(edges))
    t = _PARAM_CACHE.get(key)
    if t is None:
        values = (bits.nearest_params(fmt, policy) if kind == "nearest"
                  else rule_params(fmt, rand_bits, edges, overflow=policy))
        if len(_PARAM_CACHE) > 256:
            _PARAM_CACHE.clear()
        t = _PARAM_CACHE[key] = torch.tensor(values, dtype=torch.int32, device=device)
    return t


def nearest(x: torch.Tensor, fmt: FloatFormat, policy: str, eager=None) -> torch.Tensor:
    """RNE of a float32 tensor (any shape and layout) as a new tensor: compiled, or ``eager()``
    (a float32 result; by default the kernel function itself)."""
    p = _cached_params("nearest", fmt, policy, None, x.device)
    flat = x.reshape(-1)
    out = _KERNELS["nearest"](flat.view(torch.int32), p,
                              eager=None if eager is None else lambda: eager().view(torch.int32)).view(torch.float32)
    return out if out.shape == x.shape else out.view(x.shape)


def nearest_(x: torch.Tensor, fmt: FloatFormat, policy: str, eager=None) -> torch.Tensor:
    """RNE of a contiguous float32 tensor, in place: compiled, or ``eager()``."""
    p = _cached_params("nearest", fmt, policy, None, x.device)
    _KERNELS["nearest_"](x.view(-1).view(torch.int32), p, eager=eager)
    return x


def stochastic(x: torch.Tensor, fmt: FloatFormat, policy: str, rand_bits: Optional[int], seed: int,
               first: int = 0) -> torch.Tensor:
    """SR of a float32 tensor as a new tensor; element i of ``x`` in row-major order draws the
    hash of (seed, first + i)."""
    p = torch.tensor(bits.stochastic_params(fmt, policy, rand_bits, seed, first), dtype=torch.int32, device=x.device)
    flat = x.reshape(-1)
    out = _KERNELS["stochastic"](flat.view(torch.int32), p)
    return out.view(torch.float32).view(x.shape)


def stochastic_(x: torch.Tensor, fmt: FloatFormat, policy: str, rand_bits: Optional[int], seed: int,
                first: int = 0) -> torch.Tensor:
    """SR of a contiguous float32 tensor, in place (the same bits as :func:`stochastic`)."""
    p = torch.tensor(bits.stochastic_params(fmt, policy, rand_bits, seed, first), dtype=torch.int32, device=x.device)
    _KERNELS["stochastic_"](x.view(-1).view(torch.int32), p)
    return x


def equal_count(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """:func:`equal_count_fp32` of two flat float32 tensors, compiled or eagerly."""
    return _KERNELS["equal_count"](a, b)


def changed_blocks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """:func:`changed_blocks_fp32`, compiled or eagerly."""
    return _KERNELS["changed_blocks"](a, b)


def frozen_blocks(codes: torch.Tensor) -> torch.Tensor:
    """:func:`frozen_blocks_u8`, compiled or eagerly."""
    return _KERNELS["frozen_blocks"](codes)


CODE_LAYOUTS = ("codes", "tagged", "paired", "bytes")


def freeze_code(old: torch.Tensor, new: torch.Tensor, fmt: FloatFormat, edges: Sequence[int], out: torch.Tensor,
                layout: str = "codes", rand_bits: Optional[int] = None,
                tags: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`freeze_code_fp32` of two flat float32 tensors into ``out``, compiled or eagerly,
    with the ratio bins of ``edges`` (:func:`ratio_bin_params`); returns the sum of the move
    probabilities (float64, 0-dim). ``layout``:

    * ``"codes"``: one code per element with the few-bit flag (``out`` uint8; ``rand_bits``
      k, or None: no few-bit prediction, the flag then marks the ratios up to 1/2);
    * ``"tagged"``: the same or-ed with ``tags`` (``out`` int32; the tags of
      :meth:`lowprec_demo.packing.Pack.tags`);
    * ``"paired"`` (an even number of elements) and ``"bytes"``: without the few-bit flag, in
      the layouts of :func:`pair_pattern` (``out`` uint8), with the kernel's options for the
      format (:func:`gap_options`).

    The kernel is compiled in five variants: the codes, the tagged codes, and the three
    settings of :func:`gap_options` for the two layouts without the flag (the codes with the
    flag take the general gap handling, as few-bit prediction is the rarer case).
    """
    if layout in ("paired", "bytes"):
        p = _cached_params("freeze", fmt, None, None, old.device, edges)
        pattern = bits.pair_pattern(old.numel(), old.device, layout)
        return _KERNELS["freeze"](old, new, p, out, pattern, fewbit=False, **gap_options(fmt))
    if layout not in CODE_LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(CODE_LAYOUTS)}; got {layout!r}")
    p = _cached_params("freeze", fmt, None, rand_bits, old.device, edges)
    return _KERNELS["freeze"](old, new, p, out, tags if layout == "tagged" else None,
                              fewbit=True, infinite_gap=True, one_factor=False)


def watch_code(old: torch.Tensor, new: torch.Tensor, grad: torch.Tensor, tensor_id: torch.Tensor,
               log_lr: torch.Tensor, fmt: FloatFormat, first_edge: float, bins: int):
    """The freeze watch's codes and move probabilities of flat float32 tensors, compiled or
    eagerly (:func:`lowprec_demo.bit_kernels.watch_code_fp32`); ``tensor_id`` int32, ``log_lr``
    float32 per tensor (or 0-dim: one for all)."""
    p = _cached_params("freeze", fmt, None, None, old.device)
    return _KERNELS["watch_code"](old, new, grad, tensor_id, log_lr, p, first_edge=first_edge, bins=bins,
                                 **gap_options(fmt))


def freeze_detail(old: torch.Tensor, new: torch.Tensor, fmt: FloatFormat, overflow: Optional[str] = None):
    """Per element of two flat float32 tensors, compiled or eagerly: ``(frozen, ratio, stuck)``
    of the rule (:func:`lowprec_demo.freeze_rule.freeze_elements`) for the update ``new - old``
    at ``q(old)``, with the overflow policy ``overflow`` (default the format's own) deciding
    which weight is stuck."""
    p = _cached_params("freeze", fmt, overflow, None, old.device)
    return _KERNELS["freeze_detail"](old, new, p, **gap_options(fmt))


def compile_all(device="cpu") -> dict:
    """Compile every kernel for ``device`` now (mode "on" for the duration) and return
    :func:`status`: the first call of each is timed there, or its failure recorded."""
    previous = set_mode("on")
    try:
        x = torch.randn(4096, device=device)
        fmt = FloatFormat(5, 3)
        nearest(x, fmt, "inf")
        nearest_(x.clone(), fmt, "inf")
        stochastic(x, fmt, "inf", None, 1)
        stochastic_(x.clone(), fmt, "inf", None, 1)
        edges = range(-8, 8)   # (any edges: they are values of the parameter tensor, not of the code)
        codes = torch.empty(4096, dtype=torch.uint8, device=device)
        freeze_code(x, x + 1e-3, fmt, edges, codes)
        freeze_code(x, x + 1e-3, fmt, edges, torch.empty(4096, dtype=torch.int32, device=device), "tagged",
                    tags=torch.zeros(4096, dtype=torch.int32, device=device))
        for f in (fmt, FloatFormat(3, 0), FloatFormat(8, 7)):   # the three settings of gap_options
            freeze_code(x, x + 1e-3, f, edges, codes, "paired")
        freeze_detail(x, x + 1e-3, fmt)
        watch_code(x, x + 1e-3, x, torch.zeros(4096, dtype=torch.int32, device=device),
                   torch.zeros(1, device=device), fmt, -64.0, 769)
        equal_count(x, x + 1e-3)
        changed_blocks(x, x + 1e-3)
        frozen_blocks(torch.zeros(4096, dtype=torch.uint8, device=device))
        if x.device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        set_mode(previous)
    return status()


def fits(x: torch.Tensor, fmt: FloatFormat) -> bool:
    """Whether the fused kernels handle this tensor and format: float32 values, a format that
    float32 holds (which quantize has checked already for float32 input)."""
    return x.dtype == torch.float32 and fmt.e_max + 1 <= 128
