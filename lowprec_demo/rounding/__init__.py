"""Rounding onto a format's grid, bit for bit, and the freeze rule.

``quantize`` and ``quantize_`` round to nearest (ties to even) or stochastically; ``ulp`` is the gap at a value;
``would_freeze``, ``move_probability`` and ``update_ulp_ratio`` apply the freeze rule to a weight and an update (all
in ``core``). Underneath, ``rule`` writes the rule once, ``bits`` holds the kernels, and ``kernels`` compiles them or
runs them eagerly. The rule and the kernels work on the bit patterns of float32 or float64 tensors with integer
operations and exact floating-point ones, so they give the same bits eagerly and under ``torch.compile`` (whose C++ is
built with ``-fno-signed-zeros``, and whose Triton divides approximately unless told otherwise).
"""

from lowprec_demo.rounding.core import (ROUNDING_MODES, GeneratorLike, decay_rounds_back, draw_seed, move_probability,
                                        quantize, quantize_, random_bits, ulp, update_ulp_ratio, would_freeze)

__all__ = ["quantize", "quantize_", "ulp", "would_freeze", "move_probability", "update_ulp_ratio", "decay_rounds_back",
           "ROUNDING_MODES", "GeneratorLike", "random_bits", "draw_seed"]
