"""PNG charts of a run: the seed's two curves (AIME2025 accuracy and mean AIME2025 response length
over rollouts) and the rollout reward, with segment boundaries marked.

Read from TensorBoard events (what the backends write; EventAccumulator), or from
dumps/metrics.jsonl only when there are no event files, so a run whose TensorBoard dir was not
copied back can still be plotted. matplotlib is driven through its object API on an Agg canvas:
no display, no global pyplot state, safe on a login node and inside tests. matplotlib is imported
inside :func:`plot_run` only, so importing this module (the CLI does) costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from beam_hpc.run import metric_names
from beam_hpc.plan.plan import RunPaths
from beam_hpc.run.ledger import read_ledger
from beam_hpc.observe.status import Point, Scalars, read_scalars


@dataclass(frozen=True)
class Chart:
    filename: str
    tag: str
    title: str
    ylabel: str


CHARTS = (
    Chart("aime2025_accuracy.png", metric_names.EVAL_ACCURACY, "AIME2025 accuracy", "accuracy"),
    Chart("aime2025_response_length.png", metric_names.EVAL_RESPONSE_LEN,
          "AIME2025 mean response length", "tokens"),
    Chart("reward.png", metric_names.ROLLOUT_REWARD, "Rollout reward", "mean reward"),
)
FIGSIZE_IN = (8.0, 4.5)
DPI = 100  # 800 x 450 pixels


@dataclass
class PlotResult:
    written: list[Path] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # chart file -> why
    source: str | None = None


def segment_boundaries(run_dir: str | Path) -> list[tuple[int, str]]:
    """(rollout id where a segment started, segment id) for every segment after the first."""
    records, _ = read_ledger(RunPaths(str(run_dir)).ledger)
    out = []
    for rec in records[1:]:
        start = rec.get("start") or {}
        if start.get("rollouts_at_start") is not None:
            out.append((int(start["rollouts_at_start"]), rec["segment"]))
    return out


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> PlotResult:
    """Write one PNG per chart in ``output`` (default <run>/plots); charts with no data are
    skipped and named in the result rather than drawn empty."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    scalars: Scalars = read_scalars(run_dir)
    result = PlotResult(source=scalars.source)
    out_dir = Path(output) if output is not None else Path(run_dir) / "plots"
    bounds = segment_boundaries(run_dir)
    for chart in CHARTS:
        pts: list[Point] = scalars.series.get(chart.tag, [])
        if not pts:
            result.skipped[chart.filename] = (f"no {chart.tag!r} values in "
                                              f"{scalars.source or 'the run (no tensorboard/ or dumps/metrics.jsonl)'}")
            continue
        fig = Figure(figsize=FIGSIZE_IN, dpi=DPI)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        ax.plot([p.step for p in pts], [p.value for p in pts], marker="o", markersize=3,
                linewidth=1.5, color="tab:blue", label=chart.tag)
        for i, (x, seg) in enumerate(bounds):
            ax.axvline(x, color="tab:red", linestyle="--", linewidth=1,
                       label="segment start" if i == 0 else None)
            ax.annotate(seg, xy=(x, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -10),
                        textcoords="offset points", fontsize=7, color="tab:red")
        ax.set_title(f"{chart.title} ({Path(run_dir).name})")
        ax.set_xlabel("rollout")
        ax.set_ylabel(chart.ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        out_dir.mkdir(parents=True, exist_ok=True)
        target = out_dir / chart.filename
        tmp = target.with_name(f".{target.name}.tmp.png")
        fig.savefig(tmp, dpi=DPI)  # atomic: a reader never sees half a PNG
        tmp.replace(target)
        result.written.append(target)
    return result
