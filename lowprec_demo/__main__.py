"""``python -m lowprec_demo``: see :mod:`lowprec_demo.cli`."""
import sys

from .cli import main

sys.exit(main())
