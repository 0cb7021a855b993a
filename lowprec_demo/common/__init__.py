"""What every layer shares: files written atomically and progress bars (``output``), and one
figure style (``style``)."""
