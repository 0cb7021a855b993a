"""Sliders for a live kernel, and their kernel-free equivalents for the static site.

* :func:`interact` puts ipywidgets sliders (mantissa bits, learning rate, ...) above a figure that
  a function redraws; it needs a running kernel (Binder, Colab, local Jupyter).
* :func:`animate` renders the same function over a list of values into a self-contained HTML
  animation with a slider (matplotlib's ``to_jshtml``), which works on the rendered book.

Example:
    >>> def draw(ax, man_bits):
    ...     ax.plot([0, 1], [0, man_bits])
    >>> html = animate(draw, "man_bits", [2, 3])
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Sequence

import matplotlib.pyplot as plt
from matplotlib import animation

__all__ = ["interact", "animate", "mantissa_slider", "exponent_slider", "lr_slider", "has_widgets"]


def has_widgets() -> bool:
    """Whether ipywidgets can be imported."""
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


class Fixed:
    """What a slider becomes without ipywidgets: its initial ``value`` only."""

    def __init__(self, value) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Fixed({self.value!r})"


def _int_slider(value: int, low: int, high: int, description: str):
    if not has_widgets():
        return Fixed(value)
    import ipywidgets as w
    return w.IntSlider(value=value, min=low, max=high, step=1, description=description, continuous_update=False,
                       style={"description_width": "initial"})


def mantissa_slider(value: int = 7, low: int = 1, high: int = 12, description: str = "mantissa bits"):
    """An integer slider for the number of stored mantissa bits (a :class:`Fixed` value when
    ipywidgets is missing). Example: ``mantissa_slider(3, 1, 10)``."""
    return _int_slider(value, low, high, description)


def exponent_slider(value: int = 5, low: int = 2, high: int = 8, description: str = "exponent bits"):
    """An integer slider for the number of exponent bits (2..8). Example: ``exponent_slider(4)``."""
    return _int_slider(value, low, high, description)


def lr_slider(value: float = 0.1, low_exp: float = -4, high_exp: float = 0, description: str = "learning rate"):
    """A log-scale slider for the learning rate, from 10**low_exp to 10**high_exp (a
    :class:`Fixed` value when ipywidgets is missing). Example: ``lr_slider(0.01, -3, -1)``."""
    if not has_widgets():
        return Fixed(value)
    import ipywidgets as w
    return w.FloatLogSlider(value=value, base=10, min=low_exp, max=high_exp, step=0.25, description=description,
                            continuous_update=False, style={"description_width": "initial"}, readout_format=".2g")


def interact(draw: Callable[..., Any], figsize=(8, 4), ncols: int = 1, **controls):
    """Redraw ``draw(axes, **values)`` whenever a control changes. ``controls`` maps argument names
    to ipywidgets controls (see :func:`mantissa_slider`, :func:`lr_slider`) or to fixed values.
    ``axes`` is one matplotlib axes (or a list when ``ncols > 1``). Returns the widget box; with no
    ipywidgets installed, draws once with the initial values and says so.

    Example: ``interact(lambda ax, man_bits: ..., man_bits=mantissa_slider())``."""
    if not has_widgets():
        print("ipywidgets is not installed: showing the initial values only (pip install ipywidgets)")
        fig, axes = plt.subplots(1, ncols, figsize=figsize)
        draw(axes, **{k: getattr(v, "value", v) for k, v in controls.items()})
        plt.show()
        return None
    import ipywidgets as w
    from IPython.display import display

    out = w.Output()
    sliders = {k: v for k, v in controls.items() if isinstance(v, w.ValueWidget)}
    fixed = {k: v for k, v in controls.items() if k not in sliders}

    def redraw(**values):
        with out:
            out.clear_output(wait=True)
            fig, axes = plt.subplots(1, ncols, figsize=figsize)
            draw(axes, **fixed, **values)
            fig.tight_layout()
            plt.show()

    w.interactive_output(redraw, sliders)
    box = w.VBox([w.HBox(list(sliders.values())), out])
    display(box)
    return box


def animate(draw: Callable[..., Any], name: str, values: Sequence, figsize=(8, 4), ncols: int = 1,
            interval: int = 900, fixed: Dict[str, Any] = None):
    """A kernel-free equivalent of a slider: ``draw(axes, **{name: value}, **fixed)`` for each
    value, as one HTML animation with play controls and a frame slider. Display the returned
    object in a notebook; it stays interactive on the static site.

    Example: ``animate(draw_grid, "man_bits", [2, 3, 4, 5])``."""
    from IPython.display import HTML

    fixed = fixed or {}
    fig, axes = plt.subplots(1, ncols, figsize=figsize)
    axes_list = list(axes) if ncols > 1 else [axes]

    def frame(i):
        for ax in axes_list:
            ax.clear()
        draw(axes if ncols > 1 else axes_list[0], **fixed, **{name: values[i]})
        fig.suptitle(f"{name} = {values[i]}", fontsize=10)
        fig.tight_layout()
        return []

    anim = animation.FuncAnimation(fig, frame, frames=len(values), interval=interval, blit=False)
    html = anim.to_jshtml(default_mode="once")
    plt.close(fig)
    return HTML(html)
