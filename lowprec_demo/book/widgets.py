"""Sliders for a live kernel (:func:`interact`), and for the static site the same drawing over a
list of values as an HTML animation with a slider (:func:`animate`).

Example:
    >>> html = animate(lambda ax, man_bits: ax.plot([0, 1], [0, man_bits]), "man_bits", [2, 3])
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
    """A slider for the stored mantissa bits (a :class:`Fixed` value without ipywidgets)."""
    return _int_slider(value, low, high, description)


def exponent_slider(value: int = 5, low: int = 2, high: int = 8, description: str = "exponent bits"):
    """A slider for the exponent bits (a :class:`Fixed` value without ipywidgets)."""
    return _int_slider(value, low, high, description)


def lr_slider(value: float = 0.1, low_exp: float = -4, high_exp: float = 0, description: str = "learning rate"):
    """Log-scale learning-rate slider, 10**low_exp to 10**high_exp (a :class:`Fixed` without ipywidgets)."""
    if not has_widgets():
        return Fixed(value)
    import ipywidgets as w
    return w.FloatLogSlider(value=value, base=10, min=low_exp, max=high_exp, step=0.25, description=description,
                            continuous_update=False, style={"description_width": "initial"}, readout_format=".2g")


def interact(draw: Callable[..., Any], figsize=(8, 4), ncols: int = 1, **controls):
    """Redraw ``draw(axes, **values)`` whenever a control (a slider or a fixed value) changes; returns
    the widget box. Without ipywidgets, draws the initial values once and says so."""
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
    """A slider without a kernel: ``draw(axes, **{name: value}, **fixed)`` for each value, as one
    HTML animation with a frame slider, which stays interactive on the static site."""
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
