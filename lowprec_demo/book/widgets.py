"""Sliders for a live kernel (:func:`interact`), and for the static site the same drawing over a
list of values as an HTML animation with a slider (:func:`animate`).

Example:
    >>> html = animate(lambda ax, man_bits: ax.plot([0, 1], [0, man_bits]), "man_bits", [2, 3])
"""

from __future__ import annotations

import re
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


def interact(draw: Callable[..., Any], figsize=(7.0, 3.2), ncols: int = 1, **controls) -> None:
    """Show the sliders and ``draw(axes, **values)`` below them, redrawn whenever a control (a slider
    or a fixed value) changes. It displays the box itself and returns None, so a cell that ends with
    the call shows the box once. Without ipywidgets, draws the initial values once and says so."""
    if not has_widgets():
        print("ipywidgets is not installed: showing the initial values only (pip install ipywidgets)")
        fig, axes = plt.subplots(1, ncols, figsize=figsize)
        draw(axes, **{k: getattr(v, "value", v) for k, v in controls.items()})
        plt.show()
        return
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


# The play buttons of matplotlib's HTML animation are Font Awesome icons from a CDN: blank offline.
# The same buttons as characters every font has (U+FE0E asks for the text form, not an emoji).
_ICONS = {"fa-minus": "\u2212", "fa-fast-backward": "|\u25c0\ufe0e\u25c0\ufe0e",
          "fa-step-backward": "|\u25c0\ufe0e", "fa-play fa-flip-horizontal": "\u25c0\ufe0e",
          "fa-pause": "\u275a\u275a", "fa-play": "\u25b6\ufe0e", "fa-step-forward": "\u25b6\ufe0e|",
          "fa-fast-forward": "\u25b6\ufe0e\u25b6\ufe0e|", "fa-plus": "+"}
_ICON = re.compile(r'<i class="fa ([^"]+)"></i>')
_CDN_LINK = re.compile(r'<link rel="stylesheet"\s+href="https?://[^"]*font-awesome[^"]*">\s*')


def offline_animation_html(html: str, width_px: int) -> str:
    """matplotlib's ``to_jshtml`` page made to work offline and to read at the page's width: the
    CDN stylesheet dropped, each button icon a character (:data:`_ICONS`), and the frame shown at
    ``width_px`` CSS pixels at most (frames drawn at twice that are sharp on every screen)."""
    html = _CDN_LINK.sub("", html)
    html = _ICON.sub(lambda m: _ICONS[m.group(1)], html)
    return re.sub(r'<img id="(_anim_img[0-9a-f]+)">',
                  rf'<img id="\1" style="width: 100%; max-width: {width_px}px; height: auto;">', html)


def animate(draw: Callable[..., Any], name: str, values: Sequence, figsize=(7.0, 3.2), ncols: int = 1,
            interval: int = 900, fixed: Dict[str, Any] = None):
    """A slider without a kernel: ``draw(axes, **{name: value}, **fixed)`` for each value, as one
    HTML animation with a frame slider, which stays interactive on the static site and offline
    (:func:`offline_animation_html`). The title names the value as ``label`` says (the axis label
    of ``name``; ``man_bits`` reads "mantissa bits")."""
    from IPython.display import HTML

    fixed = fixed or {}
    label = _LABELS.get(name, name.replace("_", " "))
    fig, axes = plt.subplots(1, ncols, figsize=figsize)
    axes_list = list(axes) if ncols > 1 else [axes]

    def frame(i):
        for ax in axes_list:
            ax.clear()
        draw(axes if ncols > 1 else axes_list[0], **fixed, **{name: values[i]})
        fig.suptitle(f"{label} = {values[i]}", fontsize=10)
        fig.tight_layout()
        return []

    anim = animation.FuncAnimation(fig, frame, frames=len(values), interval=interval, blit=False)
    dpi = plt.rcParams["figure.dpi"]
    with plt.rc_context({"savefig.dpi": 2 * dpi}):    # frames at twice the page's pixels, shown at its size
        html = anim.to_jshtml(default_mode="once")
    plt.close(fig)
    return HTML(offline_animation_html(html, round(figsize[0] * dpi)))


_LABELS = {"man_bits": "mantissa bits", "exp_bits": "exponent bits", "lr": "learning rate"}
