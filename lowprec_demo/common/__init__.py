"""Shared by every layer: atomic file writes and progress bars (``output``), one figure style (``style``)."""
