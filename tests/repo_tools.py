"""The repository's tools (``tools/NAME.py``) as modules for the tests: :func:`load_tool`."""

import importlib.util
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str):
    """A fresh module of ``tools/<name>.py``, registered under ``name`` while it runs (dataclasses
    look their module up by name)."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
