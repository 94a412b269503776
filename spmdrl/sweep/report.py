"""Comparing a sweep's runs: the summary table and the plots."""
from __future__ import annotations

import os
import statistics

from spmdrl.errors import DataError

from .runner import state, steps_done  # noqa: F401
from .spec import COLUMNS, PLOTS, SEED_KEY, Run, Sweep  # noqa: F401


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(c) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(header), "-" * len(line(header)), *(line(r) for r in rows)])


def summaries(sweep: Sweep) -> list[tuple[Run, dict[str, float] | None]]:
    from spmdrl.metrics import summarize_run

    return [(r, summarize_run(r.output_dir) if steps_done(r) >= 0 else None) for r in sweep.runs]


def format_report(sweep: Sweep, rows: list[tuple[Run, dict[str, float] | None]]) -> str:
    """One line per run; with several seeds, a second table of mean ± std over the seeds."""
    if not any(s for _, s in rows):
        raise DataError(f"{sweep.path}: no run has metrics under {sweep.output_dir}; run `spmdrl sweep run {sweep.path}`")
    header = ["run", "state", *(c for c, _ in COLUMNS)]
    table = [[r.name, state(r).split(",")[0], *(_fmt(s.get(k)) if s else "-" for _, k in COLUMNS)] for r, s in rows]
    out = [_table(header, table)]
    groups: dict[str, list[dict[str, float]]] = {}
    for r, s in rows:
        if s:
            groups.setdefault(r.group, []).append(s)
    if SEED_KEY in sweep.axes and any(len(g) > 1 for g in groups.values()):
        def cell(vals):
            if not vals:
                return "-"
            return _fmt(vals[0]) if len(vals) == 1 else f"{statistics.fmean(vals):.4g} ± {statistics.stdev(vals):.3g}"

        agg = [[g, str(len(ss)), *(cell([s[k] for s in ss if k in s]) for _, k in COLUMNS[1:])] for g, ss in groups.items()]
        out += ["", "mean ± std over seeds:", _table(["config", "seeds", *(c for c, _ in COLUMNS[1:])], agg)]
    return "\n".join(out)


def write_plots(sweep: Sweep, out_dir: str) -> list[str]:
    """reward.png and val_accuracy.png: one line per run; runs that differ only by seed share a colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from spmdrl.metrics import read_jsonl

    os.makedirs(out_dir, exist_ok=True)
    curves = {r.name: read_jsonl(os.path.join(r.output_dir, "metrics.jsonl"), last_per_step=True)
              for r in sweep.runs if steps_done(r) >= 0}
    groups = list(dict.fromkeys(r.group for r in sweep.runs))
    styles = ("-", "--", ":", "-.")
    written = []
    for key, filename in PLOTS:
        fig, ax = plt.subplots(figsize=(9, 5))
        seen_in_group: dict[str, int] = {}
        for r in sweep.runs:
            pts = [(row["step"], row[key]) for row in curves.get(r.name, []) if key in row]
            if not pts:
                continue
            k = seen_in_group[r.group] = seen_in_group.get(r.group, -1) + 1
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=r.name, color=f"C{groups.index(r.group) % 10}", linestyle=styles[k % len(styles)],
                    marker="o" if len(pts) < 30 else None, markersize=3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_title(f"{sweep.name}: {key}")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        path = os.path.join(out_dir, filename)
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written
