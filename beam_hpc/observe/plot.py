"""PNG charts of a run: the seed's two curves (accuracy and mean response length on the run's
evaluation set over rollouts) and the rollout reward, with segment boundaries marked, and where
an extra rollout job (``beam-hpc rollout add``) joined or left.

The evaluation set is the run's own (beam_hpc.observe.eval_set): it names the charts' titles and
files (``<eval_name>_accuracy.png``), and each chart says which eval file and how many rows its
numbers come from. The accuracy chart has two lines where the run recorded both: beam-hpc's answer
checker and Miles's own (what the seed's published curve used). Read from TensorBoard events, or
from dumps/metrics.jsonl when those are missing or unreadable (with a warning). matplotlib runs
through its object API on an Agg canvas (no display, no global pyplot state) and is imported inside
:func:`plot_run` only, so importing this module (the CLI does) costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from beam_hpc.elastic.registry import capacity_changes, extra_jobs
from beam_hpc.errors import InputError, shorten
from beam_hpc.files import atomic_path
from beam_hpc.observe.eval_set import EvalSet, eval_set_of
from beam_hpc.observe.run_dir import check_run_dir, load_plan
from beam_hpc.plan.paths import RunPaths
from beam_hpc.run import metric_names
from beam_hpc.run.ledger import read_ledger
from beam_hpc.run.scalars import Point, Scalars, read_scalars


@dataclass(frozen=True)
class Chart:
    filename: str
    tag: str
    title: str
    ylabel: str
    on_eval_set: bool = False  # its numbers come from the evaluation set: say which data
    miles_checker: bool = False  # also draw the same set as Miles's own answer checking scored it


def charts_for(ev: EvalSet) -> tuple[Chart, ...]:
    """The charts of a run whose evaluation set is ``ev``: its two eval curves, then the reward."""
    return (
        Chart(f"{ev.name}_accuracy.png", ev.accuracy_tag, f"{ev.label} accuracy", "accuracy", True, True),
        Chart(f"{ev.name}_response_length.png", ev.response_len_tag,
              f"{ev.label} mean response length", "tokens", True),
        Chart("reward.png", metric_names.ROLLOUT_REWARD, "Rollout reward", "mean reward"),
    )


FIGSIZE_IN = (8.0, 4.5)
DPI = 100  # 800 x 450 pixels


@dataclass
class PlotResult:
    written: list[Path] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # chart file -> why
    source: str | None = None
    eval_set: EvalSet | None = None  # what the eval charts measured (name, label, data file, rows)
    warnings: list[str] = field(default_factory=list)  # skipped ledger lines, unreadable TensorBoard files


def segment_boundaries(run_dir: str | Path) -> list[tuple[int, str]]:
    """(rollout id where a segment started, segment id) for every segment after the first."""
    return segment_boundaries_and_warnings(run_dir)[0]


def segment_boundaries_and_warnings(run_dir: str | Path) -> tuple[list[tuple[int, str]], list[str]]:
    """:func:`segment_boundaries` and the ledger lines it had to skip (read_ledger's warnings)."""
    records, warnings = read_ledger(RunPaths(str(run_dir)).ledger)
    out = []
    for rec in records[1:]:
        start = rec.get("start") or {}
        if start.get("rollouts_at_start") is not None:
            out.append((int(start["rollouts_at_start"]), rec["segment"]))
    return out, warnings


def _read_plan(run_dir: Path) -> dict[str, Any] | None:
    """plan.json as a dict, or None when there is none (the charts still come out, under the seed's
    eval name or the one the metrics carry); a damaged one is bad input, named (observe.status)."""
    return load_plan(run_dir)


def check_output(output: str | Path) -> Path:
    """``-o``: a directory for the PNGs, existing or not; an existing file there is bad input (exit
    2) rather than a traceback half-way through the charts."""
    out = Path(output)
    for p in (out, *out.parents):
        if p.exists() and not p.is_dir():
            raise InputError(f"-o/--output: {shorten(str(output))} is not a directory "
                             f"({shorten(str(p))} is a file); give a directory for the PNGs")
    return out


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> PlotResult:
    """Write one PNG per chart in ``output`` (default <run>/plots); charts with no data are
    skipped and named in the result rather than drawn empty."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    run_dir = check_run_dir(run_dir)
    out_dir = check_output(output if output is not None else RunPaths(str(run_dir)).plots)
    plan = _read_plan(run_dir)
    warnings: list[str] = []
    scalars: Scalars = read_scalars(run_dir, warnings)
    ev = eval_set_of(plan, frozenset(scalars.series))
    result = PlotResult(source=scalars.source, eval_set=ev, warnings=warnings)
    bounds, ledger_warnings = segment_boundaries_and_warnings(run_dir)
    result.warnings[:0] = ledger_warnings
    capacity = capacity_changes(extra_jobs(run_dir))  # where an extra rollout job joined or left
    footnote = f"eval data: {ev.data.describe()}"
    for chart in charts_for(ev):
        pts: list[Point] = scalars.series.get(chart.tag, [])
        if not pts:
            result.skipped[chart.filename] = (f"no {chart.tag!r} values in "
                                              f"{scalars.source or 'the run (no tensorboard/ or dumps/metrics.jsonl)'}")
            continue
        fig = Figure(figsize=FIGSIZE_IN, dpi=DPI)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        ax.plot([p.step for p in pts], [p.value for p in pts], marker="o", markersize=3,
                linewidth=1.5, color="tab:blue", zorder=3,
                label=f"{chart.tag} (beam-hpc checker)" if chart.miles_checker else chart.tag)
        if chart.miles_checker:
            miles_pts, unavailable = scalars.miles_checker_accuracy(ev.name)
            if miles_pts:
                ax.plot([p.step for p in miles_pts], [p.value for p in miles_pts], marker="s", markersize=3,
                        linewidth=1.5, linestyle="--", color="tab:green", zorder=2,
                        label="Miles checker (grade_answer_verl)")  # beneath: where both agree, both show
            else:
                ax.text(0.01, 0.97, "Miles checker: " + ("unavailable where the run scored (no miles)"
                                                         if unavailable else "not recorded"),
                        transform=ax.transAxes, fontsize=7, color="dimgray", va="top")
        for i, (x, seg) in enumerate(bounds):
            ax.axvline(x, color="tab:red", linestyle="--", linewidth=1,
                       label="segment start" if i == 0 else None)
            ax.annotate(seg, xy=(x, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -10),
                        textcoords="offset points", fontsize=7, color="tab:red")
        for i, (x, kind, job) in enumerate(capacity):
            ax.axvline(x, color="tab:purple", linestyle=":", linewidth=1,
                       label="rollout capacity changed (extra job)" if i == 0 else None)
            ax.annotate(f"{job} {kind}", xy=(x, 0.0), xycoords=("data", "axes fraction"), xytext=(2, 4),
                        textcoords="offset points", fontsize=7, color="tab:purple")
        ax.set_title(f"{chart.title} ({Path(run_dir).name})")
        ax.set_xlabel("rollout")
        ax.set_ylabel(chart.ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        if chart.on_eval_set:
            fig.text(0.01, 0.01, footnote, fontsize=7, color="dimgray", ha="left", va="bottom")
            fig.tight_layout(rect=(0, 0.04, 1, 1))
        else:
            fig.tight_layout()
        out_dir.mkdir(parents=True, exist_ok=True)
        target = out_dir / chart.filename
        with atomic_path(target, durable=False) as tmp:  # a reader never sees half a PNG
            fig.savefig(tmp, dpi=DPI, format="png")
        result.written.append(target)
    return result
