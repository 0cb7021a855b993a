"""Shared by every layer: atomic file writes and progress bars (``output``), one figure style (``style``), small
tensors laid end to end in one buffer (``packing``) and where an FSDP2 process's piece lies in a tensor
(``sharding``)."""
