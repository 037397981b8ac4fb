"""The report's pictures (matplotlib, no display needed): pass/fail of composition x property, worst error
relative to its bound per composition and mode, and cases per second per composition."""

from __future__ import annotations

import sys
from pathlib import Path

GREEN, RED, GREY, BLANK = (0.55, 0.80, 0.55), (0.90, 0.35, 0.30), (0.80, 0.80, 0.80), (0.97, 0.97, 0.97)
PALE_GREEN = (0.80, 0.91, 0.80)  # every row that ran passed, but some did not run
LEGEND = ((GREEN, "ok: every row ran and passed"), (PALE_GREEN, "ok where run; some rows not run"),
          (RED, "a finding (failed, crashed, hung)"), (GREY, "not run"), (BLANK, "no such row (not applicable)"))


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


def _labels(ax, comps: list[str], cols: list[str]) -> None:
    ax.set_yticks(range(len(comps)), comps, fontsize=8)
    ax.set_xticks(range(len(cols)), cols, fontsize=8, rotation=35, ha="right")
    ax.tick_params(length=0)


def _verdict(cell: list[dict]) -> tuple[tuple, str]:
    """The colour and label of one composition x property cell (its rows over modes): counts over the rows
    that ran, and the rows that did not run apart."""
    if not cell:
        return BLANK, ""
    ran = [r for r in cell if r["status"] != "not run"]
    not_run = len(cell) - len(ran)
    if not ran:
        return GREY, "not run"
    tail = f"\n{not_run} not run" if not_run else ""
    bad = [r for r in ran if not r["ok"]]
    if bad:
        return RED, f"{bad[0]['status']} {len(bad)}/{len(ran)}{tail}"
    return (PALE_GREEN if not_run else GREEN), f"ok {len(ran)}{tail}"


def pass_fail_figure(Figure, rows: list[dict], comps: list[str]):
    from matplotlib.patches import Patch

    props = list(dict.fromkeys(r["property"] for r in rows))
    cells = [[_verdict([r for r in rows if r["composition"] == c and r["property"] == p]) for p in props]
             for c in comps]
    colour = [[colour for colour, _ in line] for line in cells]
    text = [[label for _, label in line] for line in cells]
    fig = Figure(figsize=(max(6.0, 3.5 + 0.9 * len(props)), 2.2 + 0.32 * len(comps)), layout="constrained")
    ax = fig.add_subplot()
    ax.imshow(colour, aspect="auto")
    for i, line in enumerate(text):
        for j, t in enumerate(line):
            ax.text(j, i, t, ha="center", va="center", fontsize=6 if "\n" in t else 7)
    _labels(ax, comps, props)
    ax.set_title("pass/fail: composition x property (over modes; counts: rows that ran)", fontsize=9)
    fig.legend(handles=[Patch(facecolor=c, edgecolor=(0.5, 0.5, 0.5), label=label) for c, label in LEGEND],
               loc="outside lower center", ncols=2, fontsize=7, frameon=False)
    return fig


def pass_fail(Figure, rows: list[dict], comps: list[str], path: Path) -> Path:
    pass_fail_figure(Figure, rows, comps).savefig(path, dpi=110)
    return path


def worst_error_figure(Figure, rows: list[dict], comps: list[str]):
    """Ratios on a log scale centred on 1 (where a row fails), so 1.01 and 9e5 look different."""
    import math

    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    grid = np.full((len(comps), len(modes)), np.nan)
    for r in rows:
        if r["worst_error"] is not None and r["bound"]:
            i, j = comps.index(r["composition"]), modes.index(r["mode"])
            grid[i, j] = np.fmax(grid[i, j], r["worst_error"] / r["bound"])
    positive = grid[np.isfinite(grid) & (grid > 0)]
    decades = max([1] + [math.ceil(abs(math.log10(v))) for v in positive])
    norm = LogNorm(10.0 ** -decades, 10.0 ** decades)  # symmetric in decades: 1 sits in the middle
    cmap = colormaps["RdYlGn_r"].with_extremes(bad=BLANK)
    shown = np.where(np.isnan(grid) | (grid > 0), grid, norm.vmin)  # an exact match (0) takes the scale's lowest colour
    fig = Figure(figsize=(max(6.0, 3.5 + 0.9 * len(modes)), 2.3 + 0.32 * len(comps)), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(np.ma.masked_invalid(shown), cmap=cmap, norm=norm, aspect="auto")
    for (i, j), v in np.ndenumerate(grid):
        if not np.isnan(v):
            level = norm(max(v, norm.vmin))
            ax.text(j, i, f"{v:.3g}", ha="center", va="center", fontsize=7,
                    color="white" if level > 0.85 or level < 0.15 else "black")  # readable on the darkest colours
    _labels(ax, comps, modes)
    bar = fig.colorbar(image, ax=ax, location="bottom", shrink=0.8, aspect=40)
    bar.set_label("worst error / bound (log scale; above 1 fails; white: nothing compared)", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    ax.set_title("worst error relative to its bound: composition x mode", fontsize=9)
    return fig


def worst_error(Figure, rows: list[dict], comps: list[str], path: Path) -> Path:
    worst_error_figure(Figure, rows, comps).savefig(path, dpi=110)
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
