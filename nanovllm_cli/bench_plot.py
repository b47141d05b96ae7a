"""`bench --plot FILE.png|FILE.html`: one column per step loop, three panels each: generated tokens per second over
time, the batch's rows per step against max_num_seqs, and each step's time by kind (decode only, mixed, prefill
only; eager steps drawn as crosses). HTML holds the figure as SVG under the run's headline figures. Needs
matplotlib (the `plot` extra)."""
from __future__ import annotations

import html
import io
from pathlib import Path

import numpy as np

SUFFIXES = (".png", ".html")
MISSING = "--plot needs matplotlib: pip install 'nanovllm[plot]'"
KIND_LABELS = ("decode only", "mixed", "prefill only")
KIND_COLOURS = ("tab:blue", "tab:orange", "tab:red")


def check_plot_path(path: Path) -> str | None:
    """Why `path` cannot be plotted to (a one-line error naming the fix), or None."""
    if path.suffix.lower() not in SUFFIXES:
        return f"--plot {path}: the file must end in .png or .html"
    if not path.parent.is_dir():
        return f"--plot {path}: no directory {path.parent}; create it first"
    try:
        import matplotlib  # noqa: F401 - only whether it is there
    except ImportError:
        return MISSING
    return None


def throughput_series(t: np.ndarray, tokens: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens per second in `bins` equal intervals of the run: (each interval's middle, its rate). A step's
    tokens count in the interval where the step ended."""
    if not len(t):
        return np.zeros(0), np.zeros(0)
    end = max(float(t[-1]), 1e-9)
    edges = np.linspace(0.0, end, bins + 1)
    counts, _ = np.histogram(t, bins=edges, weights=tokens)
    return (edges[:-1] + edges[1:]) / 2, counts / np.diff(edges)


def figure(timelines: dict[str, dict[str, np.ndarray]], batch_limit: int, title: str):
    """The matplotlib figure of `timelines` ({loop: EngineStats.timeline()})."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(timelines), figsize=(7 * len(timelines), 10), squeeze=False, sharex="col")
    for column, (loop, series) in enumerate(timelines.items()):
        t = series["t"]
        rate_at, rate = throughput_series(t, series["decode_rows"], max(10, min(100, len(t) // 10)))
        top, middle, bottom = axes[0, column], axes[1, column], axes[2, column]
        top.plot(rate_at, rate, color="tab:green")
        top.set_title(f"{loop} loop")
        top.set_ylabel("generated tok/s")
        middle.step(t, series["rows"], where="pre", color="tab:purple", linewidth=0.8)
        middle.axhline(batch_limit, color="grey", linestyle="--", linewidth=0.8, label=f"max_num_seqs {batch_limit}")
        middle.axhline(batch_limit / 2, color="grey", linestyle=":", linewidth=0.8, label="half")
        middle.set_ylabel("rows in the step")
        middle.legend(loc="upper right", fontsize="small")
        for kind, (label, colour) in enumerate(zip(KIND_LABELS, KIND_COLOURS)):
            for graph, marker in ((True, "."), (False, "x")):
                chosen = (series["kind"] == kind) & (series["graph"] == graph)
                if chosen.any():
                    bottom.scatter(t[chosen], 1000 * series["step_s"][chosen], s=6, marker=marker, color=colour,
                                   label=f"{label} ({'graph' if graph else 'eager'})")
        bottom.set_ylabel("step ms")
        bottom.set_xlabel("seconds since the first step")
        bottom.legend(loc="upper right", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def write_plot(path: Path, timelines: dict[str, dict[str, np.ndarray]], batch_limit: int, title: str,
               headline: dict[str, str]) -> None:
    """The figure as PNG, or as HTML (inline SVG under a table of `headline` figures)."""
    import matplotlib.pyplot as plt

    fig = figure(timelines, batch_limit, title)
    try:
        if path.suffix.lower() == ".png":
            fig.savefig(path, dpi=110)
            return
        svg = io.StringIO()
        fig.savefig(svg, format="svg")
        rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in headline.items())
        path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
                        f"<body><h1>{html.escape(title)}</h1><table>{rows}</table>{svg.getvalue()}</body></html>")
    finally:
        plt.close(fig)
