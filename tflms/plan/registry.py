"""The ordered pass registry: every transform of a step, in the one order that the planner,
the replay on the graph model and the rewrite of the TensorFlow graph follow.

=============  =============  ====================  ==================================================
pass           plan field     decided               what it does to the step
=============  =============  ====================  ==================================================
split_sums     ``sums``       before the swaps      a gradient ``AddN`` becomes a chain of ``AddV2``
drop_tiles     ``tiles``      before the swaps      the gradient of a mean is broadcast, not tiled
recompute      ``recomputes`` before the swaps      cheap tensors are recomputed, not swapped
swaps          ``swaps``      by the autotuner      tensors go to the host and come back, host-gated
fences         ``fences``     with the swaps        a forward op waits for an earlier swap-out
order_updates  ``orders``     before and with them  update orders, then the memory-aware schedule's
                                                    orders (ordering edges both)
=============  =============  ====================  ==================================================

A pass's name is its one spelling: the name a ``policy`` gives it (:data:`tflms.config.POLICIES`;
the passes decided by the autotuner, ``swaps`` and ``fences``, have none), the name in the logs and
the name of its applier in the rewrite. A plan field is named for the decisions it holds, not for
the pass: ``sums`` holds :class:`~tflms.ir.decisions.Sum` records, ``recomputes`` :class:`~tflms.Recompute`
records, and ``orders`` the :class:`~tflms.Order` edges of ``order_updates`` followed by those of
the memory-aware schedule, which is no pass of a policy (it is decided with the swaps, where the
budget needs it). :data:`POLICY_PASSES` lists the names a policy may turn on.

``offload="optimizer"`` (:mod:`tflms.plan.passes.offload`) is not a pass of this table: it is an
option of the step, applied to the step before the planner runs any pass (by ``tflms.function``,
``tflms.optimize`` and ``LMSCallback``; by :func:`replay` from a plan's options) and to the
TensorFlow graph before the plan (:func:`tflms.rewrite.apply.apply_offload`). Nor is a placement
(``devices=[...]``, ``SwapPlan.placement``, :mod:`tflms.plan.passes.place`): it is decided instead of
the passes, :func:`replay` gives each op its stage's device, and the rewrite sets the same devices on
the TensorFlow graph (:func:`tflms.rewrite.apply.apply_placement`).

A pass that is decided before the swaps runs when its name is in the config's policy;
:func:`prepare` runs them in registry order and logs what each changed. :func:`replay` applies
a plan's decisions to the graph model it was made from, in the same order (the swaps and fences
are run by the simulator, not applied). The rewrite (:func:`tflms.rewrite.apply.apply_plan`)
applies every pass to the TensorFlow graph in this order too.

Example:
    >>> [p.name for p in PASSES]
    ['split_sums', 'drop_tiles', 'recompute', 'swaps', 'fences', 'order_updates']
    >>> POLICY_PASSES
    ('split_sums', 'drop_tiles', 'recompute', 'order_updates')
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import Any

from ..config import POLICIES, LMSConfig
from ..emulate.simulator import Simulator
from ..ir.graph import GraphModel, with_orders, with_recomputes
from .passes.offload import offload_decisions, with_offload
from .passes.place import with_placement
from .passes.recompute import with_planned_recomputes
from .passes.schedule import with_update_orders
from .passes.sums import with_split_sums
from .passes.tiles import with_dropped_tiles
from .records import SwapPlan

__all__ = ["PASSES", "POLICY_PASSES", "Pass", "op_count_change", "prepare", "replay"]

log = logging.getLogger("tflms.passes")

#: ``(model, config, simulator of it) -> (model with the pass applied, its decisions, simulator of that)``.
Prepare = Callable[[GraphModel, LMSConfig, Simulator | None], tuple[GraphModel, tuple, Simulator | None]]


@dataclasses.dataclass(frozen=True)
class Pass:
    """One transform of a step.

    Attributes:
        name: the pass's name: in a ``policy`` (for a pass with ``prepare``), in logs, and the
            name of its applier in the rewrite (:class:`tflms.rewrite.apply._Rewrite`).
        field: the :class:`~tflms.SwapPlan` field that holds its decisions.
        prepare: decides the pass on a step before the swaps, where the config's policy names it
            (``None``: the autotuner decides it with the swaps; no policy names it).
        replay: applies a plan's decisions to the graph model (``None``: the simulator runs them).
    """

    name: str
    field: str
    prepare: Prepare | None
    replay: Callable[[GraphModel, Sequence[Any]], GraphModel] | None


def _resimulated(
    pass_: Callable[[GraphModel], tuple[GraphModel, list]],
) -> Prepare:
    """The prepare of a pass that reads no simulator: ``sim`` is kept where the pass changes
    nothing, else ``None`` (:func:`prepare` makes a simulator where a later pass reads one, and
    once at the end: passes that change the step one after the other cost one simulator)."""

    def prepare(
        model: GraphModel, config: LMSConfig, sim: Simulator | None
    ) -> tuple[GraphModel, tuple, Simulator | None]:
        new, decisions = pass_(model)
        if not decisions:
            return new, (), sim
        return new, tuple(decisions), None

    return prepare


def _prepare_recompute(
    model: GraphModel, config: LMSConfig, sim: Simulator | None
) -> tuple[GraphModel, tuple, Simulator | None]:
    return _resimulated(lambda m: with_planned_recomputes(m, config))(model, config, sim)


def _prepare_orders(
    model: GraphModel, config: LMSConfig, sim: Simulator | None
) -> tuple[GraphModel, tuple, Simulator | None]:
    return with_update_orders(model, sim if sim is not None else Simulator(model, config.host))


#: The passes, in the order in which they are decided before the swaps and applied.
PASSES: tuple[Pass, ...] = (
    Pass("split_sums", "sums", _resimulated(with_split_sums), lambda m, d: with_split_sums(m, d)[0]),
    Pass("drop_tiles", "tiles", _resimulated(with_dropped_tiles), lambda m, d: with_dropped_tiles(m, d)[0]),
    Pass("recompute", "recomputes", _prepare_recompute, with_recomputes),
    Pass("swaps", "swaps", None, None),
    Pass("fences", "fences", None, None),
    Pass("order_updates", "orders", _prepare_orders, with_orders),
)
#: The passes a ``policy`` may turn on, in registry order: :data:`tflms.config.POLICIES` is these
#: and ``swap_gradients`` (which adds swap candidates; it changes no step).
POLICY_PASSES: tuple[str, ...] = tuple(p.name for p in PASSES if p.prepare is not None)
if set(POLICIES) != {*POLICY_PASSES, "swap_gradients"}:  # config cannot import the registry: checked here
    raise ImportError(f"tflms.config.POLICIES {POLICIES} do not name the registry's passes {POLICY_PASSES}")


def op_count_change(before: GraphModel, after: GraphModel) -> str:
    """What a pass changed, as op-type counts: ``'AddV2 +3, AddN -1'`` (``'nothing'`` if none).

    >>> out = [("float32", (4,), 16, False)]
    >>> a = GraphModel.from_ops([{"name": "x", "type": "AddN", "inputs": [], "outputs": out}])
    >>> b = GraphModel.from_ops([{"name": "y", "type": "AddV2", "inputs": [], "outputs": out}])
    >>> op_count_change(a, b), op_count_change(a, a)
    ('AddV2 +1, AddN -1', 'nothing')
    """
    diff = Counter(dict(after.dag.nodes(data="type")).values())
    diff.subtract(Counter(dict(before.dag.nodes(data="type")).values()))
    parts = [f"{t} {n:+d}" for t, n in sorted(diff.items(), key=lambda kv: (-kv[1], kv[0])) if n]
    return ", ".join(parts) or "nothing"


def prepare(
    model: GraphModel, config: LMSConfig, sim: Simulator | None, only: Collection[str] | None = None
) -> tuple[GraphModel, Simulator, dict[str, tuple]]:
    """The step that swaps are planned on: ``model`` with the passes of ``config.policy`` that
    are decided before the swaps applied, in registry order (of them ``only`` those named, if
    given). Returns ``(model, a simulator of it, {plan field: decisions})``; ``sim``
    (``model``'s, or None) is returned when nothing changed. A simulator is made only where a
    pass reads one, and once at the end (``Simulator(model, config.host)`` of the result) where
    a pass changed the step, not one per pass that changes it."""
    decided: dict[str, tuple] = {}
    for p in PASSES:
        if p.prepare is None or p.name not in config.policy or (only is not None and p.name not in only):
            continue
        before = model
        model, decisions, sim = p.prepare(model, config, sim)
        decided[p.field] = tuple(decisions)
        log.info("tflms pass %s on %s: %s", p.name, model.name, op_count_change(before, model))
    return model, sim if sim is not None else Simulator(model, config.host), decided


def replay(model: GraphModel, plan: SwapPlan) -> GraphModel:
    """``model`` (the step ``plan`` was made from) as the plan changes it before swapping: the
    offload of its options first (``offload="optimizer"`` or ``"weights"``:
    :mod:`tflms.plan.passes.offload`, which the planner ran on the step before any pass), then
    every pass's decisions in registry order, then the placement (``devices=[...]``: each op's
    ``device`` its stage's, :mod:`tflms.plan.passes.place`). The simulator runs the swaps on it.
    A ``model`` that has the offload already (``plan.model`` of a plan made by
    :func:`tflms.function`: its device receives from the host) does not get it again."""
    offload = plan.options.get("offload")
    offloaded = any(kind == "_Recv" for _, kind in model.dag.nodes(data="type"))  # no traced step has one
    if offload in ("optimizer", "weights") and not offloaded:
        decisions = offload_decisions(model, weights=offload == "weights")
        model = with_offload(model, decisions, plan.options["host"])
    for p in PASSES:
        if p.replay is not None:
            model = p.replay(model, getattr(plan, p.field))
    return with_placement(model, plan.placement)
