"""Plot the predicted device memory of a step before and after a swap plan.

:func:`plot_memory` saves a PNG: the simulator's timeline (:mod:`tflms.simulator`,
variables included) over the step's schedule without and with the plan, the
variables baseline, the budget (when the plan was tuned to one), the schedule
positions of swap-outs and swap-ins, and the forward / backward / update phase of
each op. Every number is a prediction of the simulator, not a measurement.

matplotlib is an optional dependency (``pip install tflms[plot]``); it is imported
only when a plot is drawn. The figure is rendered with Agg without pyplot, so it
works headless and leaves the session's matplotlib backend alone.

Example:
    >>> new_cf, plan = tflms.optimize(cf, device="/device:GPU:0")   # doctest: +SKIP
    >>> plan.plot("memory.png")                                     # doctest: +SKIP
    >>> tflms.plot_memory(tflms.GraphModel.from_func_graph(cf.graph), plan, "memory.png")  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import pathlib
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import LMSWarning
from .graph import GraphModel
from .plan import SwapPlan, format_bytes
from .simulator import Simulator

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["MemoryPlotData", "memory_plot_data", "draw_memory", "plot_memory", "PHASE_COLORS"]

PHASES = ("forward", "backward", "update")

#: Background colour of each stretch of the schedule (see :meth:`MemoryPlotData.phase_spans`).
PHASE_COLORS = {"forward": "#e1ecf8", "backward": "#fde8d4", "update": "#ebe4f4", "level 0": "#f0f0f0"}

_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


@dataclasses.dataclass(frozen=True)
class MemoryPlotData:
    """What :func:`plot_memory` draws, in bytes (variables included), indexed by schedule position.

    ``before``/``after`` are the simulator's timelines plus ``variable_bytes``;
    ``phases[i]`` is the phase of ``schedule[i]``; the first ``n_sources`` ops of the
    schedule are the level-0 ones; ``swap_out_steps``/``swap_in_steps``
    are the schedule positions of each swap-out and swap-in; ``unit``/``scale`` give
    the y axis unit (``after / scale`` is what the y axis shows).
    """

    schedule: tuple[str, ...]
    before: np.ndarray
    after: np.ndarray
    variable_bytes: int
    budget: int | None
    phases: tuple[str, ...]
    n_sources: int
    swap_out_steps: tuple[int, ...]
    swap_in_steps: tuple[int, ...]
    unit: str
    scale: int

    @property
    def peak_before(self) -> int:
        return int(self.before.max(initial=self.variable_bytes))

    @property
    def peak_after(self) -> int:
        return int(self.after.max(initial=self.variable_bytes))

    def phase_spans(self, resolution: int = 100) -> list[tuple[str, int, int]]:
        """Stretches of the schedule to shade, as ``(label, start, stop)`` (stop exclusive).

        The first stretch holds the level-0 ops (constants, inputs, variable handles:
        ``'level 0'``). The rest is cut into ``resolution`` windows, each labelled with
        the phase most of its ops have (phases interleave: e.g. a layer's update runs
        as soon as its gradient is ready, during the backward pass), and equal
        neighbours are merged.
        """
        n, n0 = len(self.phases), self.n_sources
        spans: list[tuple[str, int, int]] = [("level 0", 0, n0)] if n0 else []
        width = max(1, -(-(n - n0) // resolution))
        for a in range(n0, n, width):
            window = self.phases[a : a + width]
            label = max(PHASES, key=lambda p: (window.count(p), -PHASES.index(p)))
            if spans and spans[-1][0] == label:
                spans[-1] = (label, spans[-1][1], min(a + width, n))
            else:
                spans.append((label, a, min(a + width, n)))
        return spans


def memory_plot_data(model: GraphModel, plan: SwapPlan) -> MemoryPlotData:
    """Simulate ``model`` without and with ``plan`` (on ``plan.options['host']``): the data of the plot.

    Raises ``ValueError`` when ``plan`` names ops that ``model`` lacks (a plan made
    from another step, or ``model`` built from the rewritten graph).
    """
    _check_matches(model, plan)
    sim = Simulator(model, plan.options.get("host"))
    plain, planned = sim.profile(), sim.profile(plan.swaps)
    if plain.peak_bytes != plan.peak_bytes_before:
        warnings.warn(
            f"tflms.plot_memory: the model's predicted peak ({plain.peak_bytes} bytes) differs from the one "
            f"recorded in the plan ({plan.peak_bytes_before} bytes): the model was built with other tensor "
            f"sizes than the plan. Build it with GraphModel.from_func_graph(cf.graph, "
            f"batch_size={plan.options.get('batch_size')!r}).",
            LMSWarning,
            stacklevel=3,
        )
    var = model.variable_bytes
    before = plain.timeline.astype(np.int64) + var
    after = planned.timeline.astype(np.int64) + var
    top = max(int(before.max(initial=var)), int(after.max(initial=var)), plan.options.get("budget") or 0)
    unit, scale = next((u, s) for u, s in _UNITS if top >= s or s == 1)
    return MemoryPlotData(
        schedule=plain.schedule,
        before=before,
        after=after,
        variable_bytes=var,
        budget=plan.options.get("budget"),
        phases=tuple(model.phase(op) for op in plain.schedule),
        n_sources=sum(1 for op in plain.schedule if model.level(op) == 0),
        swap_out_steps=planned.swap_out_steps,
        swap_in_steps=planned.swap_in_steps,
        unit=unit,
        scale=scale,
    )


def _check_matches(model: GraphModel, plan: SwapPlan) -> None:
    nodes = model.dag.nodes
    names = [
        name
        for s in plan.swaps
        for name in (
            s.producer,
            *(si.trigger for si in s.swap_ins if si.trigger),
            *(c for si in s.swap_ins for c, _ in si.consumers),
        )
    ]
    missing = [n for n in names if n not in nodes]
    if missing or (plan.n_ops and plan.n_ops != model.dag.number_of_nodes()):
        raise ValueError(
            f"The graph model does not match the plan: the plan was made from a step of {plan.n_ops} ops, "
            f"the model has {model.dag.number_of_nodes()}"
            + (f" and lacks {len(missing)} ops the plan names (e.g. {missing[0]!r})" if missing else "")
            + ". Pass the GraphModel of the step the plan was made from, before tflms rewrote it: "
            "tflms.GraphModel.from_func_graph(cf.graph). Received: model with "
            f"{model.dag.number_of_nodes()} ops"
        )


def draw_memory(data: MemoryPlotData, ax: Axes, *, title: str | None = None) -> dict[str, Any]:
    """Draw ``data`` on ``ax``; return the artists by name (``'before'``, ``'after'``, ...).

    The y axis shows ``bytes / data.scale`` in ``data.unit``; the x axis is the
    schedule position.
    """
    from matplotlib import ticker

    s = data.scale
    x = np.arange(len(data.before))
    xform = ax.get_xaxis_transform()  # x in data, y in axes fraction
    artists: dict[str, Any] = {}

    for label, start, stop in data.phase_spans():
        ax.axvspan(start - 0.5, stop - 0.5, facecolor=PHASE_COLORS[label], edgecolor="none", zorder=0)
        if stop - start >= 0.06 * len(x):
            text = "constants, inputs (level 0)" if label == "level 0" else label
            ax.text((start + stop) / 2, 0.985, text, transform=xform, ha="center", va="top", fontsize=9,
                    color="#555555", zorder=7)  # fmt: skip
    artists["variables"] = ax.axhspan(
        0, data.variable_bytes / s, facecolor="#bbbbbb", alpha=0.45, edgecolor="none", zorder=1,
        label=f"variables: {format_bytes(data.variable_bytes)}",
    )  # fmt: skip
    fills = (
        ("saved", data.before - data.after, "tab:green", "freed by swapping"),
        ("added", data.after - data.before, "tab:red", "added by swap-ins"),
    )
    for name, diff, color, label in fills:
        if (diff > 0).any():
            artists[name] = ax.fill_between(
                x, data.after / s, data.before / s, where=diff > 0, step="mid", color=color, alpha=0.3,
                linewidth=0, zorder=2, label=label,
            )  # fmt: skip
    less = (1 - data.peak_after / data.peak_before) * 100 if data.peak_before else 0.0
    # The plain curve is drawn wider, under the planned one: where they agree it shows as a red rim.
    (artists["before"],) = ax.plot(
        x, data.before / s, color="tab:red", linewidth=2.0, alpha=0.75, drawstyle="steps-mid", zorder=3,
        label=f"without plan: peak {format_bytes(data.peak_before)}",
    )  # fmt: skip
    (artists["after"],) = ax.plot(
        x, data.after / s, color="tab:blue", linewidth=1.0, drawstyle="steps-mid", zorder=4,
        label=f"with plan: peak {format_bytes(data.peak_after)} ({less:.0f}% less)",
    )  # fmt: skip
    for name, series, color in (("peak_before", data.before, "tab:red"), ("peak_after", data.after, "tab:blue")):
        if len(series):
            k = int(np.argmax(series))
            (artists[name],) = ax.plot([k], [series[k] / s], "o", color=color, markersize=4, zorder=5)
    if data.budget:
        artists["budget"] = ax.axhline(
            data.budget / s, color="black", linestyle="--", linewidth=1.0, zorder=3,
            label=f"budget: {format_bytes(data.budget)}",
        )  # fmt: skip
    # Swap ops as a rug along the bottom: swap-outs on the lower row, swap-ins above.
    if data.swap_out_steps:
        artists["swap_out"] = ax.vlines(
            data.swap_out_steps, 0.0, 0.035, transform=xform, color="tab:purple", linewidth=0.8, zorder=6,
            label=f"swap-out ({len(data.swap_out_steps)})",
        )  # fmt: skip
    if data.swap_in_steps:
        artists["swap_in"] = ax.vlines(
            data.swap_in_steps, 0.045, 0.08, transform=xform, color="tab:cyan", linewidth=0.8, zorder=6,
            label=f"swap-in ({len(data.swap_in_steps)})",
        )  # fmt: skip

    ax.set_xlim(-0.5, max(len(x) - 0.5, 0.5))
    top = max(data.peak_before, data.peak_after, data.budget or 0)
    ax.set_ylim(0, top / s * 1.12 if top else 1)
    ax.yaxis.set_major_formatter(ticker.StrMethodFormatter("{x:,.0f}" if top / s >= 10 else "{x:,.1f}"))
    ax.set_ylabel(f"predicted device memory ({data.unit})")
    ax.set_xlabel("schedule position (op index; ops ordered by topological level)")
    ax.set_title(title or "tflms: predicted device memory (simulator)", fontsize=11)
    handles = [
        artists[k]
        for k in ("before", "after", "saved", "added", "variables", "budget", "swap_out", "swap_in")
        if k in artists
    ]
    ax.figure.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    ax.grid(axis="y", color="white", linewidth=0.8, zorder=1)
    return artists


def plot_memory(
    model: GraphModel,
    plan: SwapPlan,
    path: str | pathlib.Path,
    *,
    title: str | None = None,
    figsize: tuple[float, float] = (11.0, 5.0),
    dpi: int = 100,
) -> pathlib.Path:
    """Save a PNG of the predicted device memory of ``model``'s step before and after ``plan``.

    ``model`` is the graph model of the step the plan was made from (not the
    rewritten one); the image is ``figsize * dpi`` pixels. Returns the path written.
    See :func:`memory_plot_data` for the numbers drawn and :meth:`tflms.SwapPlan.plot`
    for plans that remember their model.

    Example:
        >>> model = tflms.GraphModel.from_func_graph(cf.graph)                 # doctest: +SKIP
        >>> plan = tflms.make_plan(model, tflms.LMSConfig(budget="6GiB"))     # doctest: +SKIP
        >>> tflms.plot_memory(model, plan, "memory.png", title="ResNet50, batch 64")  # doctest: +SKIP
        PosixPath('memory.png')
    """
    data = memory_plot_data(model, plan)
    try:
        # A bare Figure renders with Agg and never touches pyplot or the session's backend.
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            f"tflms.plot_memory needs matplotlib: pip install 'tflms[plot]' (or matplotlib>=3.8). ({err})"
        ) from err

    path = pathlib.Path(path)
    fig = Figure(figsize=figsize, dpi=dpi, layout="constrained")
    ax = fig.add_subplot()
    if title is None:
        name = plan.function or model.name or "step"
        title = (
            f"{name}: predicted device memory (simulator) — {len(plan.swaps)} tensors swapped, "
            f"{format_bytes(plan.swapped_bytes)} out per step"
        )
    draw_memory(data, ax, title=title)
    fig.savefig(path, dpi=dpi, format="png")
    return path
