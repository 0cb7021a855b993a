"""Rounding onto a format's grid, bit for bit, and the freeze rule.

:mod:`~lowprec_demo.rounding.round_to_grid` rounds to nearest (ties to even) or stochastically (``quantize``,
``quantize_``) and holds the one optional ``torch.compile`` step; :mod:`~lowprec_demo.rounding.freeze_rule` writes the
freeze rule once (``would_freeze``, ``move_probability``, ``update_ulp_ratio``, the gap ``ulp`` and the step codes the
freeze counts use).
"""

from lowprec_demo.rounding.freeze_rule import decay_rounds_back, move_probability, ulp, update_ulp_ratio, would_freeze
from lowprec_demo.rounding.round_to_grid import (ROUNDING_MODES, GeneratorLike, draw_seed, quantize, quantize_,
                                                 random_bits)

__all__ = ["quantize", "quantize_", "ulp", "would_freeze", "move_probability", "update_ulp_ratio", "decay_rounds_back",
           "ROUNDING_MODES", "GeneratorLike", "random_bits", "draw_seed"]
