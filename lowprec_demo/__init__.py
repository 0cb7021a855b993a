"""lowprec_demo: watch weights freeze in low-precision training, and predict when.

When an optimizer update is smaller than half the unit in the last place (ULP) of a stored
weight, round-to-nearest hands back the same weight. This package simulates any small float
format exactly (bit for bit), wraps any torch optimizer so stored weights live on that format's
grid, predicts from a high-precision run when each weight freezes, and plots it.
"""

from .formats import FORMAT_NAMES, FloatFormat, format_table, get_format
from .rounding import move_probability, quantize, ulp, update_ulp_ratio, would_freeze

__version__ = "0.1.0"
