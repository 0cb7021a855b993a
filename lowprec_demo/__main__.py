"""``python -m lowprec_demo``: the book's command line, :mod:`lowprec_demo.book.cli`."""
import sys

from lowprec_demo.book.cli import main

sys.exit(main())
