"""What a pass is: :class:`Pass`, one class per transform of a step with its three sides, and
:class:`GraphEdit`, the TensorFlow graph a plan's rewrite edits.

A pass's three sides sit in one class, in its module of :mod:`tflms.plan.passes`:

* :meth:`Pass.prepare`: its planning, decided on the graph model before the swaps (only a pass
  that a ``policy`` names: :attr:`Pass.policy`);
* :meth:`Pass.replay`: its decisions applied to the graph model, so that the planner and the
  simulator see the step as it will run;
* :meth:`Pass.rewrite`: its decisions applied to the TensorFlow graph.

The rewrite side reads TensorFlow, which is imported where a rewrite runs (planning imports no
TensorFlow), and the graph-editing helpers of :mod:`tflms._tf_internal`: both sit below the
``plan`` stage, so a pass class can hold its rewrite without importing :mod:`tflms.rewrite`.
:mod:`tflms.plan.registry` lists the passes in order and checks what each needs
(:attr:`Pass.needs`); :func:`tflms.rewrite.apply.apply_plan` runs their rewrites in that order.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import networkx as nx

if TYPE_CHECKING:
    from ...config import LMSConfig
    from ...emulate.simulator import Simulator
    from ...ir.graph import GraphModel
    from ..records import SwapPlan

__all__ = ["Pass", "TransformPass", "GraphEdit", "Edges", "changed", "op_dag"]

#: The control edges a pass's rewrite adds: ``{(before op, after op): what makes the edge}``.
Edges = dict[tuple[str, str], str]


class Pass:
    """One transform of a step: its planning, its replay on the graph model and its rewrite of
    the TensorFlow graph. Subclasses set the class attributes and override the sides they have.

    Attributes:
        name: the pass's one spelling: in a ``policy`` (:attr:`policy` passes), in the logs.
        field: the :class:`~tflms.SwapPlan` field that holds its decisions.
        policy: whether a ``policy`` turns it on (it is decided before the swaps, by
            :meth:`prepare`); the others are decided by the autotuner, with the swaps.
        needs: the passes that must come before it in the registry
            (:func:`tflms.plan.registry.check`); those that a policy names must be in a policy
            that names this one (:data:`tflms.config.POLICY_NEEDS`).
        adds_edges: whether its rewrite adds control edges (:meth:`edges`): the rewrite checks
            them all for a cycle before the first such pass edits the graph.
    """

    name: ClassVar[str]
    field: ClassVar[str]
    policy: ClassVar[bool] = False
    needs: ClassVar[tuple[str, ...]] = ()
    adds_edges: ClassVar[bool] = False

    def prepare(
        self, model: GraphModel, config: LMSConfig, sim: Simulator | None
    ) -> tuple[GraphModel, tuple, Simulator | None]:
        """``(model with the pass decided and applied, its decisions, a simulator of that or None)``;
        ``sim`` (of ``model``, or None) is returned where nothing changed."""
        raise NotImplementedError(f"the pass {self.name!r} is decided with the swaps, not before them")

    def replay(self, model: GraphModel, decisions: Sequence[Any]) -> GraphModel:
        """``model`` with ``decisions`` applied; by default ``model`` (the simulator runs them)."""
        return model

    def names(self, decisions: Sequence[Any]) -> list[str]:
        """The ops that ``decisions`` name in the step they were made from (or that an earlier
        pass makes: :meth:`made`, :meth:`made_again_from`), which a model of that step must have
        (:func:`tflms.report.plot.memory_plot_data` checks); none by default."""
        return []

    def made(self, decisions: Sequence[Any]) -> set[str]:
        """The names of the ops the rewrite of ``decisions`` makes that later decisions may name."""
        return set()

    def made_again_from(self, name: str) -> str | None:
        """The op that op ``name`` is made again from, where this pass makes ops again under new
        names that its decisions do not list (``drop_tiles``); else ``None``."""
        return None

    def rewrote(self, op: Any, attr: bytes | None) -> bool:
        """Whether the TensorFlow ``op`` (its ``_tflms_swap`` attribute ``attr``, or None) is one that
        this pass's rewrite added or changed: a graph that holds one is rewritten already."""
        return False

    def edges(self, edit: GraphEdit) -> Edges:
        """The control edges :meth:`rewrite` will add to ``edit.graph`` as it is now: the rewrite
        asks each pass that :attr:`adds_edges` before the first of them edits the graph, and
        refuses a plan whose edges make a cycle."""
        return {}

    def rewrite(self, edit: GraphEdit) -> dict[str, int]:
        """Apply the plan's decisions of this pass to ``edit.graph``; return op counts by kind."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<pass {self.name}>"


def changed(
    new: GraphModel, decisions: Sequence[Any], sim: Simulator | None
) -> tuple[GraphModel, tuple, Simulator | None]:
    """What :meth:`Pass.prepare` returns for a pass that reads no simulator: ``sim`` is kept where
    the pass decided nothing, else ``None`` (:func:`tflms.plan.registry.prepare` makes a simulator
    where a later pass reads one, and once at the end: passes that change the step one after the
    other cost one simulator)."""
    return (new, tuple(decisions), None) if decisions else (new, (), sim)


class TransformPass(Pass):
    """A policy pass decided and replayed by one function of the graph model, :meth:`transform`
    (``split_sums``, ``drop_tiles``), that reads no simulator."""

    policy = True

    def transform(self, model: GraphModel, decisions: Sequence[Any] | None = None) -> tuple[GraphModel, list]:
        """``(model with decisions applied, the decisions)``; ``decisions=None``: decide them."""
        raise NotImplementedError

    def prepare(
        self, model: GraphModel, config: LMSConfig, sim: Simulator | None
    ) -> tuple[GraphModel, tuple, Simulator | None]:
        return changed(*self.transform(model), sim)

    def replay(self, model: GraphModel, decisions: Sequence[Any]) -> GraphModel:
        return self.transform(model, decisions)[0]


class GraphEdit:
    """A TensorFlow graph that a plan's rewrite edits in place, pass after pass.

    Attributes:
        graph, plan: the graph and the plan applied to it.
        device: where the step runs (its unplaced ops, the consumers of swap-ins).
        host: where the swap ops go.
        swap_in_on: ``'host'`` or ``'device'`` (:func:`tflms.rewrite.apply.apply_plan`).
        made: what a pass made that a later one reads, by the maker's name (the ``swaps`` pass's
            swap-outs, which ``fences`` gate on).
        found: what a pass found on the graph in :meth:`Pass.edges`, kept for its own rewrite.
    """

    def __init__(self, graph: Any, plan: SwapPlan, device: str, host: str, swap_in_on: str = "host") -> None:
        self.graph, self.plan, self.device, self.host, self.swap_in_on = graph, plan, device, host, swap_in_on
        self.made: dict[str, Any] = {}
        self.found: dict[str, Any] = {}

    def error(self, what: str) -> ValueError:
        """The error of a plan that does not fit the graph: ``what`` says how."""
        return ValueError(
            f"The plan does not fit this function: {what}. Make the plan from the same traced "
            f"function (same model, input signature and options). Received: plan for {self.plan.function!r}"
        )

    def lookup(self, kind: str, get: Callable[[str], Any], name: str) -> Any:
        """``get(name)``, or the plan's error naming the ``kind`` of thing that is missing."""
        try:
            return get(name)
        except (KeyError, ValueError):
            raise self.error(f"no {kind} {name!r}") from None

    def op(self, kind: str, name: str) -> Any:
        """The op ``name`` of the graph (see :meth:`lookup`)."""
        return self.lookup(kind, self.graph.get_operation_by_name, name)

    def tensor(self, name: str) -> Any:
        """The tensor ``name`` of the graph (see :meth:`lookup`)."""
        return self.lookup("tensor", self.graph.get_tensor_by_name, name)

    def rewire(self, consumers: Collection[tuple[str, int]], old: Any, new: Any, what: str) -> None:
        """Make each of ``consumers`` (``(op, input index)``, reading ``old``: the tensor named
        ``what``) read ``new`` instead."""
        from ... import _tf_internal as tfi

        for op_name, index in consumers:
            op = self.op("consumer op", op_name)
            if index >= len(op.inputs) or op.inputs[index].name != old.name:
                raise self.error(f"input {index} of {op_name!r} is not {what!r}")
            tfi.update_input(op, index, new)


def op_dag(graph: Any) -> nx.DiGraph:
    """The ops of the TensorFlow ``graph`` (by name) with their data and control edges."""
    dag = nx.DiGraph()
    for op in graph.get_operations():
        dag.add_node(op.name)
        dag.add_edges_from((t.op.name, op.name) for t in op.inputs)
        dag.add_edges_from((c.name, op.name) for c in op.control_inputs)
    return dag
