"""The package's version, in a module of its own so that any module can read it without
importing the package (``lowprec_demo.__version__`` is this string)."""

__version__ = "0.1.0"
