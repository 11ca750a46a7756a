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
the passes decided by the autotuner, ``swaps`` and ``fences``, have none) and the name in the logs.
A plan field is named for the decisions it holds, not for
the pass: ``sums`` holds :class:`~tflms.ir.decisions.Sum` records, ``recomputes`` :class:`~tflms.Recompute`
records, and ``orders`` the :class:`~tflms.Order` edges of ``order_updates`` followed by those of
the memory-aware schedule, which is no pass of a policy (it is decided with the swaps, where the
budget needs it). :data:`POLICY_PASSES` lists the names a policy may turn on.

Each pass is one object (:class:`~tflms.plan.passes.base.Pass`) with its three sides side by side:
its planning (``prepare``), its replay on the graph model (``replay``) and its rewrite of the
TensorFlow graph (``rewrite``). The classes live in :mod:`tflms.plan.passes`, beside the planning
they run: a rewrite imports TensorFlow when it runs and edits the graph with
:mod:`tflms._tf_internal`, both below the ``plan`` stage, so no pass reaches into
:mod:`tflms.rewrite`, and the planner, the replay and the rewrite all read this one list.

* ``split_sums``: :class:`~tflms.plan.passes.sums.SplitSums`;
* ``drop_tiles``: :class:`~tflms.plan.passes.tiles.DropTiles`, needs ``split_sums``;
* ``recompute``: :class:`~tflms.plan.passes.recompute.RecomputePass`;
* ``swaps``: :class:`~tflms.plan.passes.swaps.Swaps`;
* ``fences``: :class:`~tflms.plan.passes.swaps.Fences`, needs ``swaps`` (its rewrite gates on
  their swap-outs);
* ``order_updates``: :class:`~tflms.plan.passes.orders.OrderUpdates`.

A pass declares the passes it needs (:attr:`~tflms.plan.passes.base.Pass.needs`): :func:`check`
refuses, at import, a registry where a need is missing or comes after the pass. A policy that names
a pass and not a pass it needs is refused when the config is made, by
:data:`tflms.config.POLICY_NEEDS`: the config sits below every stage and cannot import the
registry, so that table mirrors the needs the passes declare, and this module checks at import
that it does (as it checks :data:`tflms.config.POLICIES`).

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

import logging
from collections import Counter
from collections.abc import Collection, Sequence

from ..config import POLICIES, POLICY_NEEDS, LMSConfig
from ..emulate.simulator import Simulator
from ..ir.graph import GraphModel
from .passes.base import Pass
from .passes.offload import offload_decisions, with_offload
from .passes.orders import OrderUpdates
from .passes.place import with_placement
from .passes.recompute import RecomputePass
from .passes.sums import SplitSums
from .passes.swaps import Fences, Swaps
from .passes.tiles import DropTiles
from .records import SwapPlan

__all__ = ["PASSES", "POLICY_PASSES", "NEEDS_IN_POLICY", "Pass", "check", "op_count_change", "prepare", "replay"]

log = logging.getLogger("tflms.passes")


def check(passes: Sequence[Pass]) -> tuple[Pass, ...]:
    """``passes`` as a registry: refuses (``ValueError``) two passes of one name, and a pass whose
    need (:attr:`Pass.needs`) is not a pass of ``passes`` or comes after it.

    >>> [p.name for p in check([SplitSums(), DropTiles()])]
    ['split_sums', 'drop_tiles']
    >>> check([DropTiles(), SplitSums()])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: pass 'drop_tiles' needs 'split_sums' before it; it comes after. Received: ...
    """
    names = [p.name for p in passes]
    received = f"Received: passes {names}"
    for i, p in enumerate(passes):
        if p.name in names[:i]:
            raise ValueError(f"two passes are named {p.name!r}. {received}")
        for need in p.needs:
            if need not in names:
                raise ValueError(f"pass {p.name!r} needs {need!r}, which is no pass of the registry. {received}")
            if names.index(need) > i:
                raise ValueError(f"pass {p.name!r} needs {need!r} before it; it comes after. {received}")
    return tuple(passes)


#: The passes, in the order in which they are decided before the swaps and applied.
PASSES: tuple[Pass, ...] = check((SplitSums(), DropTiles(), RecomputePass(), Swaps(), Fences(), OrderUpdates()))
#: The passes a ``policy`` may turn on, in registry order: :data:`tflms.config.POLICIES` is these
#: and ``swap_gradients`` (which adds swap candidates; it changes no step).
POLICY_PASSES: tuple[str, ...] = tuple(p.name for p in PASSES if p.policy)
#: What a pass of a policy needs in the policy too: ``(pass, needed pass)`` for each need that is a
#: pass of a policy.
NEEDS_IN_POLICY: frozenset[tuple[str, str]] = frozenset(
    (p.name, n) for p in PASSES if p.policy for n in p.needs if n in POLICY_PASSES
)
# The config sits below the registry and cannot import it: its tables are checked here.
if set(POLICIES) != {*POLICY_PASSES, "swap_gradients"}:
    raise ImportError(f"tflms.config.POLICIES {POLICIES} do not name the registry's passes {POLICY_PASSES}")
if {(name, need) for name, need, _ in POLICY_NEEDS} != NEEDS_IN_POLICY:
    raise ImportError(f"tflms.config.POLICY_NEEDS {POLICY_NEEDS} are not the passes' needs {sorted(NEEDS_IN_POLICY)}")


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
        if not p.policy or p.name not in config.policy or (only is not None and p.name not in only):
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
        model = p.replay(model, getattr(plan, p.field))
    return with_placement(model, plan.placement)
