"""Matplotlib helpers shared by the result, model-card and diagnostics plots (headless Agg backend)."""

from __future__ import annotations

import pathlib

from .utils import atomic_path


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path, dpi: int = 110, ax=None) -> str:
    """Finish ``ax`` (grid, legend), then write ``fig`` atomically (temp file, rename) and close it."""
    if ax is not None:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    path = pathlib.Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, bbox_inches="tight")
    pyplot().close(fig)
    return str(path)
