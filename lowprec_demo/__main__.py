"""``python -m lowprec_demo``: see :mod:`lowprec_demo.cli`."""
import sys

from lowprec_demo.cli import main

sys.exit(main())
