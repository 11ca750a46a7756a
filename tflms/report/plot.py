"""Plot the predicted device memory of a step before and after a swap plan.

:func:`plot_memory` saves a PNG: the simulator's timeline (:mod:`tflms.emulate.simulator`,
variables included) over the step's schedule without and with the plan, the
variables baseline, the budget (when the plan was tuned to one), the schedule
positions of swap-outs and swap-ins, and the forward / backward / update phase of
each stretch of the schedule. The level-0 ops (constants, inputs, variable
handles: often a quarter of a training step's ops, none of them computing anything)
are left off the x axis; the memory they hold is in the curves.
Every number is a prediction of the simulator, not a measurement.

matplotlib is an optional dependency (``pip install tflms[plot]``); it is imported
only when a plot is drawn. The figure is rendered with Agg without pyplot, so it
works headless and leaves the session's matplotlib backend alone.

A plan made by ``new_cf, plan = tflms.optimize(cf)`` remembers its model, and then
``tflms.plot_plan(plan, "memory.png")`` is enough (the example of :func:`plot_plan`).
"""

from __future__ import annotations

import dataclasses
import pathlib
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from .._util import format_bytes
from ..emulate.simulator import Simulator
from ..errors import LMSWarning
from ..ir.graph import ALIAS_OP_TYPES, GraphModel, reach
from ..plan.registry import PASSES, replay

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from ..plan.records import SwapPlan

__all__ = ["MemoryPlotData", "memory_plot_data", "draw_memory", "plot_memory", "plot_plan", "PHASE_COLORS"]

PHASES = ("forward", "backward", "update")

#: Background colour of each stretch of the schedule (see :meth:`MemoryPlotData.phase_spans`).
PHASE_COLORS = {"forward": "#e1ecf8", "backward": "#fde8d4", "update": "#ebe4f4"}

_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


@dataclasses.dataclass(frozen=True)
class MemoryPlotData:
    """What :func:`plot_memory` draws, in bytes (variables included), indexed by schedule position.

    ``before``/``after`` are the simulator's timelines plus ``variable_bytes``;
    ``phases[i]`` is the phase of ``schedule[i]`` (:meth:`tflms.GraphModel.phase`) and
    ``stages[i]`` the stage it is shaded as: its phase, except that a forward op that
    feeds the optimizer update and no backward op (the optimizer's own arithmetic, e.g.
    Adam's bias correction) counts as ``'update'``; ``op_bytes[i]`` are the bytes of the
    outputs ``schedule[i]`` allocates (0 for ops that alias their input, e.g. ``Identity``,
    ``Reshape``; :data:`tflms.ir.graph.ALIAS_OP_TYPES`); ``n_sources`` ops are at level 0
    (constants, inputs, variable handles); ``shown`` are the schedule positions that
    are drawn, in order: every op above level 0 (every op when all are at level 0).
    The x axis is the index into ``shown`` (:meth:`drawn`). ``swap_out_steps`` /
    ``swap_in_steps`` are the schedule positions of each swap-out and swap-in;
    ``unit``/``scale`` give the y axis unit (``after / scale`` is what the y axis shows).
    """

    schedule: tuple[str, ...]
    before: np.ndarray
    after: np.ndarray
    variable_bytes: int
    budget: int | None
    phases: tuple[str, ...]
    stages: tuple[str, ...]
    op_bytes: np.ndarray
    n_sources: int
    shown: tuple[int, ...]
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

    def drawn(self, steps: Any) -> np.ndarray:
        """x positions of schedule positions ``steps``: their index in :attr:`shown`.

        A position that is not drawn (a level-0 op) maps to the next drawn one.
        """
        return np.searchsorted(np.asarray(self.shown, dtype=np.int64), np.asarray(steps, dtype=np.int64))

    def phase_spans(self, resolution: int = 100, min_fraction: float = 0.05) -> list[tuple[str, int, int]]:
        """Stretches of the x axis to shade, as ``(phase, start, stop)`` in drawn positions (stop exclusive).

        The drawn ops (:attr:`shown`) are cut into ``resolution`` windows, each
        labelled with the stage (:attr:`stages`) of most of its work: the stage whose ops
        weigh most, an op weighing ``1 + op_bytes`` (phases interleave: e.g. a layer's
        update runs as soon as its gradient is ready, during the backward pass, and
        scalar arithmetic of every stage runs among the big tensors' ops). Equal
        neighbours are merged. Then a stretch narrower than
        ``min_fraction`` of the axis between two stretches of one other phase is
        absorbed by them, narrowest first: the shape arithmetic of the gradients
        (``Shape``, ``Pack``, ``BroadcastGradientArgs``, ...) runs among the forward
        ops and would otherwise show as slivers of "backward" inside the forward
        pass. The stretches cover ``[0, len(shown))`` in order.
        """
        phases = [self.stages[i] for i in self.shown]
        weights = [1 + int(self.op_bytes[i]) for i in self.shown]
        n = len(phases)
        spans: list[tuple[str, int, int]] = []
        width = max(1, -(-n // resolution))
        for a in range(0, n, width):
            weight = dict.fromkeys(PHASES, 0)
            for phase, w in zip(phases[a : a + width], weights[a : a + width]):
                weight[phase] += w
            label = max(PHASES, key=lambda p: (weight[p], -PHASES.index(p)))
            if spans and spans[-1][0] == label:
                spans[-1] = (label, spans[-1][1], min(a + width, n))
            else:
                spans.append((label, a, min(a + width, n)))
        return _absorb_narrow(spans, min_fraction * n)


def _absorb_narrow(spans: list[tuple[str, int, int]], narrow: float) -> list[tuple[str, int, int]]:
    """Merge narrow stretches into their neighbours, narrowest first (see ``phase_spans``).

    A stretch narrower than ``narrow`` between two stretches of one label takes that
    label; one narrower than ``0.4 * narrow`` (a sliver) takes the label of its wider
    neighbour whatever the labels. Adjacent stretches of one label are then merged.
    """
    spans = list(spans)
    while len(spans) > 1:
        candidates = []
        for i, (_, a, b) in enumerate(spans):
            left = spans[i - 1] if i > 0 else None
            right = spans[i + 1] if i + 1 < len(spans) else None
            island = left is not None and right is not None and left[0] == right[0]
            if (island and b - a < narrow) or b - a < 0.4 * narrow:
                candidates.append((b - a, i, left, right))
        if not candidates:
            break
        _, i, left, right = min(candidates, key=lambda c: c[:2])
        wider = max((n for n in (left, right) if n is not None), key=lambda n: n[2] - n[1])
        spans[i] = (wider[0], spans[i][1], spans[i][2])
        merged: list[tuple[str, int, int]] = []
        for label, a, b in spans:
            if merged and merged[-1][0] == label:
                merged[-1] = (label, merged[-1][1], b)
            else:
                merged.append((label, a, b))
        spans = merged
    return spans


def memory_plot_data(model: GraphModel, plan: SwapPlan) -> MemoryPlotData:
    """Simulate ``model`` without and with ``plan`` (on ``plan.options['host']``): the data of the plot.

    Raises ``ValueError`` when ``plan`` names ops that ``model`` lacks (a plan made
    from another step, or ``model`` built from the rewritten graph).
    """
    _check_matches(model, plan)
    plain = Simulator(model, plan.options.get("host")).profile()
    planned_model = replay(model, plan)
    planned = Simulator(planned_model, plan.options.get("host")).profile(plan.swaps)
    planned = _on_schedule(planned, plain.schedule)
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
    stages = _stages(model)
    shown = tuple(i for i, op in enumerate(plain.schedule) if model.level(op) != 0) or tuple(range(len(plain.schedule)))
    unit, scale = next((u, s) for u, s in _UNITS if top >= s or s == 1)
    return MemoryPlotData(
        schedule=plain.schedule,
        before=before,
        after=after,
        variable_bytes=var,
        budget=plan.options.get("budget"),
        phases=tuple(model.phase(op) for op in plain.schedule),
        stages=tuple(stages[op] for op in plain.schedule),
        op_bytes=np.array([_output_bytes(model, op) for op in plain.schedule], dtype=np.int64),
        n_sources=len(plain.schedule) - len(shown),
        shown=shown,
        swap_out_steps=planned.swap_out_steps,
        swap_in_steps=planned.swap_in_steps,
        unit=unit,
        scale=scale,
    )


def _on_schedule(profile: Any, schedule: tuple[str, ...]) -> Any:
    """``profile`` (of a model with recompute clones) on ``schedule`` (the plain step's ops):
    each op shows the highest memory since the previous op of ``schedule`` ran (so a
    clone's memory shows at the next original op); swap steps move the same way."""
    if profile.schedule == schedule:
        return profile
    index = {op: i for i, op in enumerate(schedule)}
    timeline = np.zeros(len(schedule), dtype=np.int64)
    moved = np.zeros(len(profile.schedule), dtype=np.int64)  # planned position -> plain position
    running = 0
    pending = []
    for p, op in enumerate(profile.schedule):
        running = max(running, int(profile.timeline[p]))
        pending.append(p)
        if op in index:
            timeline[index[op]] = running
            moved[pending] = index[op]
            running, pending = 0, []
    moved[pending] = len(schedule) - 1
    return dataclasses.replace(
        profile,
        schedule=schedule,
        timeline=timeline,
        swap_out_steps=tuple(int(moved[p]) for p in profile.swap_out_steps),
        swap_in_steps=tuple(int(moved[p]) for p in profile.swap_in_steps),
    )


def _output_bytes(model: GraphModel, op: str) -> int:
    """Bytes ``op`` allocates for its outputs (0 for an op whose output aliases its input)."""
    if model.dag.nodes[op]["type"] in ALIAS_OP_TYPES:
        return 0
    return sum(model.tensors[t].bytes for t in model.outputs_of[op] if t in model.tensors)


def _stages(model: GraphModel) -> dict[str, str]:
    """The stage each op is shaded as (see :class:`MemoryPlotData`): its phase, or ``'update'``
    for a forward op that feeds an update op and no backward op."""
    dag = model.dag
    phases = {op: model.phase(op) for op in dag}

    def feeding(phase: str) -> set[str]:  # ops with a path into an op of ``phase`` (other than those)
        return reach(dag.predecessors, {op for op, p in phases.items() if p == phase})

    into_backward, into_update = feeding("backward"), feeding("update")
    return {
        op: "update" if p == "forward" and op in into_update and op not in into_backward else p
        for op, p in phases.items()
    }


def _check_matches(model: GraphModel, plan: SwapPlan) -> None:
    """Refuse a model that lacks an op that a pass's decisions name
    (:meth:`tflms.plan.passes.base.Pass.names`), other than the ops a pass makes
    (:meth:`~tflms.plan.passes.base.Pass.made`, :meth:`~tflms.plan.passes.base.Pass.made_again_from`)."""
    nodes = model.dag.nodes
    made = {name for p in PASSES for name in p.made(getattr(plan, p.field))}

    def ours(name: str) -> bool:
        bases = (p.made_again_from(name) for p in PASSES)
        return name in made or any(base is not None and (base in nodes or base in made) for base in bases)

    names = [name for p in PASSES for name in p.names(getattr(plan, p.field)) if not ours(name)]
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
    from matplotlib.patches import Patch

    s = data.scale
    shown = np.asarray(data.shown, dtype=np.int64)  # the level-0 ops are not drawn
    x = np.arange(len(shown))
    before, after = data.before[shown], data.after[shown]
    xform = ax.get_xaxis_transform()  # x in data, y in axes fraction
    artists: dict[str, Any] = {}

    spans = data.phase_spans()
    for label, start, stop in spans:
        ax.axvspan(start - 0.5, stop - 0.5, facecolor=PHASE_COLORS[label], edgecolor="none", zorder=0)
        if stop - start >= 0.06 * len(x):
            ax.text((start + stop) / 2, 0.985, label, transform=xform, ha="center", va="top", fontsize=9,
                    color="#555555", zorder=7)  # fmt: skip
    shown_phases = {label for label, _, _ in spans}
    for phase in PHASES:  # every shaded stretch is named in the legend, however narrow
        if phase in shown_phases:
            artists[f"phase_{phase}"] = Patch(facecolor=PHASE_COLORS[phase], edgecolor="#bbbbbb", label=phase)
    artists["variables"] = ax.axhspan(
        0, data.variable_bytes / s, facecolor="#bbbbbb", alpha=0.45, edgecolor="none", zorder=1,
        label=f"variables: {format_bytes(data.variable_bytes)}",
    )  # fmt: skip
    fills = (
        ("saved", before - after, "tab:green", "freed by swapping"),
        ("added", after - before, "tab:red", "added by swap-ins"),
    )
    for name, diff, color, label in fills:
        if (diff > 0).any():
            artists[name] = ax.fill_between(
                x, after / s, before / s, where=diff > 0, step="mid", color=color, alpha=0.3,
                linewidth=0, zorder=2, label=label,
            )  # fmt: skip
    less = (1 - data.peak_after / data.peak_before) * 100 if data.peak_before else 0.0
    # The plain curve is drawn wider, under the planned one: where they agree it shows as a red rim.
    (artists["before"],) = ax.plot(
        x, before / s, color="tab:red", linewidth=2.0, alpha=0.75, drawstyle="steps-mid", zorder=3,
        label=f"without plan: peak {format_bytes(data.peak_before)}",
    )  # fmt: skip
    (artists["after"],) = ax.plot(
        x, after / s, color="tab:blue", linewidth=1.0, drawstyle="steps-mid", zorder=4,
        label=f"with plan: peak {format_bytes(data.peak_after)} ({abs(less):.0f}% {'less' if less >= 0 else 'more'})",
    )  # fmt: skip
    for name, series, color in (("peak_before", before, "tab:red"), ("peak_after", after, "tab:blue")):
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
            data.drawn(data.swap_out_steps), 0.0, 0.035, transform=xform, color="tab:purple", linewidth=0.8, zorder=6,
            label=f"swap-out ({len(data.swap_out_steps)})",
        )  # fmt: skip
    if data.swap_in_steps:
        artists["swap_in"] = ax.vlines(
            data.drawn(data.swap_in_steps), 0.045, 0.08, transform=xform, color="tab:cyan", linewidth=0.8, zorder=6,
            label=f"swap-in ({len(data.swap_in_steps)})",
        )  # fmt: skip

    ax.set_xlim(-0.5, max(len(x) - 0.5, 0.5))
    top = max(data.peak_before, data.peak_after, data.budget or 0)
    ax.set_ylim(0, top / s * 1.12 if top else 1)
    ax.yaxis.set_major_formatter(ticker.StrMethodFormatter("{x:,.0f}" if top / s >= 10 else "{x:,.1f}"))
    ax.set_ylabel(f"predicted device memory ({data.unit})")
    hidden = len(data.schedule) - len(shown)
    left_out = f"; its {hidden} level-0 ops (constants, inputs, variables) left out, their memory counted"
    ax.set_xlabel(f"op index in the simulated schedule{left_out if hidden else ''}")
    ax.set_title(title or "tflms: predicted device memory (simulator)", fontsize=11)
    keys = ("before", "after", "saved", "added", "variables", "budget", "swap_out", "swap_in")
    handles = [artists[k] for k in (*keys, *(f"phase_{p}" for p in PHASES)) if k in artists]
    ax.figure.legend(handles=handles, loc="outside lower center", ncol=5, fontsize=8, frameon=False)
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
    See :func:`memory_plot_data` for the numbers drawn and :func:`tflms.plot_plan`
    for plans that remember their model.

    Example (the module's example has the imports; a plan tuned to a budget also
    draws the budget line):
        >>> import tempfile, tensorflow as tf, tflms
        >>> from tflms.testing.zoo import build
        >>> _, x, y, train_step = build("cnn", batch=8, size=32)
        >>> model = tflms.GraphModel.from_func_graph(tf.function(train_step).get_concrete_function(x, y).graph)
        >>> budget = int(0.9 * tflms.simulate(model, ()).peak_bytes)
        >>> plan = tflms.make_plan(model, tflms.LMSConfig(budget=budget, knobs=tflms.Knobs(swapout_threshold=20)))
        >>> tflms.plot_memory(model, plan, tempfile.mkdtemp() + "/memory.png", title="CNN, batch 8").suffix
        '.png'
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


def plot_plan(plan: SwapPlan, path: str | pathlib.Path, model: GraphModel | None = None, **kwargs: Any) -> pathlib.Path:
    """Save the predicted memory timeline, before and after ``plan``, as a PNG.

    ``model`` defaults to the graph model the plan was made from; a plan loaded
    from JSON has none, so pass ``model=tflms.GraphModel.from_func_graph(cf.graph)``
    of the (not rewritten) traced step. ``kwargs`` go to :func:`plot_memory`.

    Example:
        >>> import tempfile, tensorflow as tf, tflms
        >>> from tflms.testing.zoo import build
        >>> model, x, y, train_step = build("cnn", batch=8, size=32)
        >>> cf = tf.function(train_step).get_concrete_function(x, y)
        >>> graph = tflms.GraphModel.from_func_graph(cf.graph)
        >>> plan = tflms.make_plan(graph, tflms.LMSConfig(knobs=tflms.Knobs(swapout_threshold=20)))
        >>> tflms.plot_plan(plan, tempfile.mkdtemp() + "/memory.png").name
        'memory.png'
    """
    model = model if model is not None else plan.model
    if model is None:
        raise ValueError(
            "This plan holds no graph model (it was loaded from JSON, built by hand, or made "
            "by tflms.optimize for an already rewritten function), so it "
            "cannot be simulated for plotting. Pass the traced step's graph model, e.g. "
            "tflms.plot_plan(plan, path, model=tflms.GraphModel.from_func_graph(cf.graph, "
            f"batch_size={plan.options.get('batch_size')!r})) where cf is the step's "
            "ConcreteFunction before tflms rewrote it. Received: model=None"
        )
    return plot_memory(model, plan, path, **kwargs)
