"""The report's pictures (matplotlib, no display needed): pass/fail of composition x property, worst error
relative to its bound per composition and mode, and cases per second per composition."""

from __future__ import annotations

import sys
from pathlib import Path

GREEN, RED, GREY, BLANK = (0.55, 0.80, 0.55), (0.90, 0.35, 0.30), (0.80, 0.80, 0.80), (0.97, 0.97, 0.97)


def write_plots(rows: list[dict], out_dir: Path) -> list[Path]:
    """PNG files in ``out_dir``; none (with a note) where matplotlib is missing or there are no rows."""
    if not rows:
        return []
    try:
        from matplotlib.figure import Figure  # no pyplot: no global state, no display backend
    except ImportError:
        print("note: matplotlib is not installed; the report has no plots", file=sys.stderr)
        return []
    comps = list(dict.fromkeys(r["composition"] for r in rows))
    out_dir.mkdir(parents=True, exist_ok=True)
    return [pass_fail(Figure, rows, comps, out_dir / "pass_fail.png"),
            worst_error(Figure, rows, comps, out_dir / "worst_error.png"),
            cases_per_second(Figure, rows, comps, out_dir / "cases_per_second.png")]


def _grid_figure(Figure, n_rows: int, n_cols: int):
    return Figure(figsize=(3.5 + 0.9 * n_cols, 1.4 + 0.32 * n_rows), layout="constrained")


def _labels(ax, comps: list[str], cols: list[str]) -> None:
    ax.set_yticks(range(len(comps)), comps, fontsize=8)
    ax.set_xticks(range(len(cols)), cols, fontsize=8, rotation=35, ha="right")
    ax.tick_params(length=0)


def _verdict(cell: list[dict]) -> tuple[tuple, str]:
    """The colour and label of one composition x property cell (its rows over modes)."""
    bad = [r for r in cell if not r["ok"]]
    if not cell:
        return BLANK, ""
    if bad:
        return RED, bad[0]["status"]
    if all(r["status"] == "not run" for r in cell):
        return GREY, "not run"
    return GREEN, "ok"


def pass_fail(Figure, rows: list[dict], comps: list[str], path: Path) -> Path:
    props = list(dict.fromkeys(r["property"] for r in rows))
    cells = [[_verdict([r for r in rows if r["composition"] == c and r["property"] == p]) for p in props]
             for c in comps]
    colour = [[colour for colour, _ in line] for line in cells]
    text = [[label for _, label in line] for line in cells]
    fig = _grid_figure(Figure, len(comps), len(props))
    ax = fig.add_subplot()
    ax.imshow(colour, aspect="auto")
    for i, line in enumerate(text):
        for j, t in enumerate(line):
            ax.text(j, i, t, ha="center", va="center", fontsize=7)
    _labels(ax, comps, props)
    ax.set_title("pass/fail: composition x property (over modes)", fontsize=9)
    fig.savefig(path, dpi=110)
    return path


def worst_error(Figure, rows: list[dict], comps: list[str], path: Path) -> Path:
    import numpy as np
    from matplotlib import colormaps

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    grid = np.full((len(comps), len(modes)), np.nan)
    for r in rows:
        if r["worst_error"] is not None and r["bound"]:
            i, j = comps.index(r["composition"]), modes.index(r["mode"])
            grid[i, j] = np.fmax(grid[i, j], r["worst_error"] / r["bound"])
    cmap = colormaps["RdYlGn_r"].copy()
    cmap.set_bad(BLANK)
    fig = _grid_figure(Figure, len(comps), len(modes) + 1)
    ax = fig.add_subplot()
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    for (i, j), v in np.ndenumerate(grid):
        if not np.isnan(v):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if v > 0.9 or v < 0.1 else "black")  # readable on the darkest colours
    _labels(ax, comps, modes)
    fig.colorbar(image, ax=ax, label="worst error / bound (over 1 fails)", shrink=0.8)
    ax.set_title("worst error relative to its bound: composition x mode", fontsize=9)
    fig.savefig(path, dpi=110)
    return path


def cases_per_second(Figure, rows: list[dict], comps: list[str], path: Path) -> Path:
    from search.outcome import throughput

    rates = {c: n / s if s else 0.0 for c, n, s in throughput(rows)}
    fig = Figure(figsize=(7.5, 1.2 + 0.3 * len(comps)), layout="constrained")
    ax = fig.add_subplot()
    ax.barh(range(len(comps)), [rates[c] for c in comps], color=(0.35, 0.55, 0.80))
    ax.set_yticks(range(len(comps)), comps, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("cases per second (search time, generation included)", fontsize=8)
    ax.set_title("throughput per composition", fontsize=9)
    fig.savefig(path, dpi=110)
    return path
