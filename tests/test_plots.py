"""The chapters' figures: what the plotting functions draw, checked on a real run."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt   # noqa: E402
import numpy as np                # noqa: E402

import lowprec_demo as lp         # noqa: E402
from lowprec_demo.book import plots    # noqa: E402
from lowprec_demo.book.results import describe   # noqa: E402


def _run():
    return lp.book.run_experiment("quadratic", fmt="e8m4", steps=60, progress=False)


def test_plot_run_draws_the_losses_beside_the_frozen_fraction():
    result = _run()
    fig, axes = plt.subplots(1, 2)
    returned = plots.plot_run(result, axes, title="e8m4, quick", smooth=5, show_sr=False, loss_ylim=(1e-3, 10.0))
    assert list(returned) == list(axes)
    loss_ax, frozen_ax = axes
    assert loss_ax.get_title() == "e8m4, quick" and frozen_ax.get_title() == "frozen fraction"
    assert loss_ax.get_ylim() == (1e-3, 10.0)
    # one loss line per variant, each the 5-step running mean of its losses
    lines = [line for line in loss_ax.get_lines() if len(line.get_ydata()) == result.config.steps]
    assert len(lines) == len(result.runs)
    nearest = np.asarray(result.runs["nearest"].loss)
    assert np.allclose(lines[1].get_ydata()[4:], np.convolve(nearest, np.ones(5) / 5, mode="valid"))
    # the frozen panel: the prediction and the observation, no SR curve
    ys = [line.get_ydata() for line in frozen_ax.get_lines() if len(line.get_ydata()) == result.config.steps]
    assert np.allclose(ys[0], result.prediction.overall)
    assert np.allclose(ys[1], result.runs["nearest"].frozen.overall)
    assert len(ys) == 2
    plt.close(fig)


def test_plot_run_makes_its_axes_and_shows_sr_by_default():
    result = _run()
    axes = plots.plot_run(result)
    curves = [line for line in axes[1].get_lines() if len(line.get_ydata()) == result.config.steps]
    assert len(curves) == 4   # predicted and observed frozen, SR predicted and observed still
    plt.close(axes[0].figure)


def test_provenance_label_is_the_line_of_describe():
    result = _run()
    assert plots.provenance_label(result) == describe(result)
    assert describe(result).endswith(f"{result.config.steps} steps, seed {result.config.seed}")


def test_text_in_the_palettes_colours_reads_on_white():
    """Every colour of the palette, as text (text_color), has a contrast of at least 4.5:1 on white;
    the shade keeps the hue's order of channels (a darker orange is still orange)."""
    from lowprec_demo.common.style import PALETTE, text_color

    def luminance(hex_color):
        channels = [int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
        lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    for name, color in PALETTE.items():
        shade = text_color(color)
        assert 1.05 / (luminance(shade) + 0.05) >= 4.5, (name, shade)
        rgb = lambda h: [int(h[i:i + 2], 16) for i in (1, 3, 5)]  # noqa: E731
        assert sorted(range(3), key=lambda i: rgb(color)[i]) == sorted(range(3), key=lambda i: rgb(shade)[i]) \
            or len(set(rgb(color))) == 1, (name, shade)
    assert text_color("0.6") == "0.6" and text_color("#123456") == "#123456"
