"""Sums added as their terms arrive (the pass ``split_sums`` of a policy): each large gradient ``AddN`` of
three or more terms becomes a chain of two-input ``AddV2`` ops, bit-identical to the ``AddN``.

An ``AddN`` runs when its last term exists, so every term waits on the device until then
(or is swapped out and back in for it). In DenseNet121's backward pass a feature map's
gradient is such a sum of up to four feature-map-sized terms made one after the other.
A chain of ``AddV2`` adds each term to a running sum once it and the terms before it
exist: the terms already added are freed, and the ``AddN``'s working set of ``n`` inputs
and an output becomes two inputs and an output.

Bit-identical, by construction (both facts pinned in ``tests/test_tf_internals.py``):

* TensorFlow's ``AddN`` kernel (``aggregate_ops.cc``) adds its inputs left to right in the
  first group of ``n % 8`` (8 when that is 0, 9 when it is 1) inputs, then adds each further
  group of eight, summed left to right, to the running sum (``out += in1 + ... + in8``):
  :func:`kernel_groups`. The chain makes the same sums in the same association; each
  ``AddV2`` rounds like the kernel's step (a float sum of two, in either order).
* Grappler sorts a commutative op's inputs by name (the ``NodeDef`` input strings, ``op``
  for output 0, ``op:i`` otherwise) before it runs, so the plain step's ``AddN`` sums in that
  order, not in graph order: :func:`term_order`.
* Grappler's arithmetic optimizer would fold the chain back into one ``AddN``
  (``AddOpsRewrite``). It leaves alone ops it has already rewritten, which it marks with the
  attribute :data:`ADD_OPS_TAG`; each op of the chain carries it.

Only ``AddN`` ops of the backward pass are split, of a float dtype, with no control inputs or
control outputs, read by no ``AddN`` that is not split itself (the chain's last op has a new
name, and Grappler's name sort of that ``AddN``'s inputs could change). The simulator and the
planner see the step with the chains (:func:`with_split_sums`); the rewrite adds them first
(:func:`apply_sums`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...ir.decisions import Sum
from ...ir.graph import GraphModel, op_records
from .base import GraphEdit, TransformPass

__all__ = [
    "ADD_OPS_TAG",
    "SUM_DTYPES",
    "SplitSums",
    "kernel_groups",
    "term_order",
    "chain_ops",
    "splittable_sums",
    "with_split_sums",
    "apply_sums",
]

#: The attribute with which Grappler's arithmetic optimizer marks the ops its ``AddOpsRewrite``
#: stage made (``kAddOpsRewriteTag`` in TF 2.21's ``arithmetic_optimizer.cc``); it rewrites no
#: op that carries it.
ADD_OPS_TAG = "_grappler_ArithmeticOptimizer_AddOpsRewriteStage"
#: The dtypes of the sums that are split.
SUM_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


def kernel_groups(n: int) -> list[list[int]]:
    """How TensorFlow's ``AddN`` kernel associates ``n`` inputs: the indices of each group,
    in order. The first group is summed left to right; each later group is summed left to right
    and then added to the sum so far.

    >>> kernel_groups(4)
    [[0, 1, 2, 3]]
    >>> kernel_groups(11)
    [[0, 1, 2], [3, 4, 5, 6, 7, 8, 9, 10]]
    >>> [len(g) for g in kernel_groups(17)]
    [9, 8]
    """
    if n < 2:
        raise ValueError(f"kernel_groups needs n >= 2 inputs. Received: n={n!r}")
    first = min(n, {0: 8, 1: 9}.get(n % 8, n % 8))
    return [list(range(first))] + [list(range(j, min(j + 8, n))) for j in range(first, n, 8)]


def term_order(tensors: Sequence[str]) -> list[str]:
    """``tensors`` (``op:i`` names) in the order Grappler sorts a commutative op's inputs.

    >>> term_order(["b:0", "a:1", "a:0", "a/x:0"])
    ['a:0', 'a/x:0', 'a:1', 'b:0']
    """
    return sorted(tensors, key=lambda t: t[:-2] if t.endswith(":0") else t)


def chain_name(addn: str, k: int) -> str:
    """Name of the ``k``-th ``AddV2`` of ``addn``'s chain.

    >>> chain_name("AddN_3", 0)
    'AddN_3/tflms_sum_0'
    """
    return f"{addn}/tflms_sum_{k}"


def chain_ops(s: Sum) -> list[str]:
    """The names of the ops of ``s``'s chain, the last one the sum's new producer.

    >>> chain_ops(Sum("AddN_3", ("a:0", "b:0", "c:0")))
    ['AddN_3/tflms_sum_0', 'AddN_3/tflms_sum_1']
    """
    return [chain_name(s.op, k) for k in range(len(_steps(s.terms)))]


def _steps(terms: Sequence[str]) -> list[tuple[str, str]]:
    """The chain's additions as ``(left, right)`` input pairs; ``'<k>'`` names the k-th step's sum."""
    steps: list[tuple[str, str]] = []
    groups = kernel_groups(len(terms))
    total = terms[groups[0][0]]
    for i in groups[0][1:]:
        steps.append((total, terms[i]))
        total = f"<{len(steps) - 1}>"
    for group in groups[1:]:
        part = terms[group[0]]
        for i in group[1:]:
            steps.append((part, terms[i]))
            part = f"<{len(steps) - 1}>"
        steps.append((total, part))
        total = f"<{len(steps) - 1}>"
    return steps


def splittable_sums(model: GraphModel) -> list[Sum]:
    """The sums of ``model`` that :func:`with_split_sums` splits (see the module doc), in graph order."""
    dag, tensors = model.dag, model.tensors
    found: dict[str, Sum] = {}
    for op, data in dag.nodes(data=True):
        inputs = model.inputs_of[op]
        if data["type"] != "AddN" or len(inputs) < 3 or data["phase"] != "backward":
            continue
        if any(dag.edges[u, op]["control"] for u in dag.predecessors(op)):
            continue
        if any(dag.edges[op, v]["control"] for v in dag.successors(op)):
            continue
        out = model.outputs_of[op][0]
        if tensors[out].dtype not in SUM_DTYPES:
            continue
        found[op] = Sum(op=op, terms=tuple(term_order(inputs)))
    # A sum read by an AddN of 3+ inputs that is not split keeps its name: not split either.
    changed = True
    while changed:
        changed = False
        for op in list(found):
            readers = {c for c, _ in tensors[model.outputs_of[op][0]].consumers}
            if any(dag.nodes[c]["type"] == "AddN" and len(model.inputs_of[c]) >= 3 and c not in found for c in readers):
                del found[op]
                changed = True
    return list(found.values())


def with_split_sums(model: GraphModel, sums: Sequence[Sum] | None = None) -> tuple[GraphModel, list[Sum]]:
    """``(model with each of sums split into its chain, the sums)``; ``sums`` defaults to
    :func:`splittable_sums`. ``model`` itself when there are none."""
    sums = splittable_sums(model) if sums is None else list(sums)
    if not sums:
        return model, []
    records = op_records(model)
    replaced: dict[str, str] = {}  # a split sum's output -> its chain's last output
    chains: list[str] = []  # the chain ops made so far
    for s in sums:
        rec = records.pop(s.op, None)
        if rec is None or rec["type"] != "AddN" or sorted(rec["inputs"]) != sorted(replaced.get(t, t) for t in s.terms):
            raise ValueError(
                f"The split of sum {s.op!r} does not fit this model: it is not an AddN of {list(s.terms)}. "
                "Make the plan from this model."
            )
        steps = _steps([replaced.get(t, t) for t in s.terms])
        for k, (a, b) in enumerate(steps):
            ins = [f"{chain_name(s.op, int(x[1:-1]))}:0" if x.startswith("<") else x for x in (a, b)]
            records[chain_name(s.op, k)] = {**rec, "name": chain_name(s.op, k), "type": "AddV2", "inputs": ins}
        last = f"{chain_name(s.op, len(steps) - 1)}:0"
        replaced[f"{s.op}:0"] = last
        # Its readers: the model's (a reader split later sums `replaced`), and chains made before.
        readers = [r for r, _ in model.tensors[f"{s.op}:0"].consumers if r in records] + chains
        for reader in readers:
            records[reader]["inputs"] = [last if t == f"{s.op}:0" else t for t in records[reader]["inputs"]]
        chains += [chain_name(s.op, k) for k in range(len(steps))]
    split = GraphModel.from_ops(
        records.values(), variable_bytes=model.variable_bytes, name=model.name, variables=model.variables
    )
    return split, sums


def apply_sums(graph: Any, sums: Sequence[Sum], device: str, lookup: Any) -> int:
    """Add the chains of ``sums`` to ``graph`` and rewire each sum's readers to its chain's last
    op; return the number of ops added. The ``AddN`` itself is left unread (Grappler prunes it)."""
    import tensorflow as tf

    from ... import _tf_internal as tfi

    replaced: dict[str, Any] = {}
    n = 0
    for s in sums:
        addn = lookup("sum op", graph.get_operation_by_name, s.op)
        terms = [replaced[t] if t in replaced else lookup("tensor", graph.get_tensor_by_name, t) for t in s.terms]
        if addn.type != "AddN" or sorted(t.name for t in addn.inputs) != sorted(t.name for t in terms):
            raise ValueError(
                f"The plan does not fit this function: {s.op!r} is not an AddN of {list(s.terms)}. Make the plan "
                "from the same traced function (same model, input signature and options)."
            )
        made: list[Any] = []
        for k, (a, b) in enumerate(_steps([str(i) for i in range(len(terms))])):
            x, y = (made[int(v[1:-1])] if v.startswith("<") else terms[int(v)] for v in (a, b))
            with graph.as_default(), tf.control_dependencies(None), tf.device(addn.device or device):
                out = tf.raw_ops.AddV2(x=x, y=y, name=chain_name(s.op, k))
            if out.op.name != chain_name(s.op, k):
                raise ValueError(f"tflms: cannot name the sum {chain_name(s.op, k)!r}: that name is taken")
            tfi.set_attr(out.op, ADD_OPS_TAG, True)
            tfi.set_attr(out.op, "_tflms_swap", "sum")
            made.append(out)
            n += 1
        old = addn.outputs[0]
        replaced[old.name] = made[-1]
        for consumer in list(old.consumers()):
            for index, t in enumerate(consumer.inputs):
                if t is old:
                    tfi.update_input(consumer, index, made[-1])
    return n


class SplitSums(TransformPass):
    """A gradient ``AddN`` becomes a chain of ``AddV2`` (the pass ``split_sums`` of a policy). It
    comes first: the other passes' decisions name the chains' ops."""

    name, field = "split_sums", "sums"

    def names(self, decisions: Sequence[Sum]) -> list[str]:
        return [s.op for s in decisions]

    def made(self, decisions: Sequence[Sum]) -> set[str]:
        return {name for s in decisions for name in chain_ops(s)}

    def transform(self, model: GraphModel, decisions: Sequence[Sum] | None = None) -> tuple[GraphModel, list[Sum]]:
        return with_split_sums(model, decisions)

    def rewrote(self, op: Any, attr: bytes | None) -> bool:
        return op.type == "AddV2" and attr == b"sum"

    def rewrite(self, edit: GraphEdit) -> dict[str, int]:
        return {"sum": apply_sums(edit.graph, edit.plan.sums, edit.device, edit.lookup)}
