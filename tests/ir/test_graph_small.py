"""GraphModel of hand-built graphs: levels, phases, edges, the byte estimate."""

import pytest

from tflms.emulate.grappler import with_constant_pushdown
from tflms.emulate.order import ready_order
from tflms.ir.graph import GraphModel, estimate_bytes

from graphs import chain_model, chained_pushdown_model, f32, op

pytestmark = pytest.mark.unit


def test_levels_phases_and_edges_of_hand_built_graph():
    m = chain_model(n_fwd=3)
    assert [m.level(n) for n in ("x", "f0", "f1", "f2", "loss")] == [0, 1, 2, 3, 4]
    assert [m.level(f"gradient_tape/b{i}") for i in (2, 1, 0)] == [5, 6, 7]
    assert m.phase("f1") == "forward"
    assert m.phase("gradient_tape/b1") == "backward"
    assert m.phase("update") == "update"
    (t,) = m.dag.edges["f1", "gradient_tape/b1"]["tensors"]
    assert (t.name, t.dtype, t.shape, t.bytes) == ("f1:0", "float32", (8, 128), 8 * 128 * 4)
    assert m.tensors["f1:0"].consumers == (("f2", 0), ("gradient_tape/b1", 1))
    assert ready_order(m)[:3] == ["x", "f0", "f1"]


def test_control_edges_are_kept_and_marked():
    ops = [
        op("a", "Relu", outputs=[f32(2, 2)]),
        op("b", "Relu", ["a:0"], [f32(2, 2)]),
        op("c", "NoOp", control=["a", "b"]),
        op("d", "Relu", ["a:0", "a:0"], [f32(2, 2)], control=["a"]),
    ]
    m = GraphModel.from_ops(ops)
    assert m.dag.edges["a", "c"] == {"tensors": (), "control": True}
    assert [t.name for t in m.dag.edges["a", "d"]["tensors"]] == ["a:0", "a:0"]
    assert m.dag.edges["a", "d"]["control"] is True
    assert m.level("c") == 2 and m.level("d") == 1


def test_estimate_bytes_rule():
    assert estimate_bytes((None, 10), 4, batch_size=16) == (640, True)
    assert estimate_bytes((None, 10), 4, batch_size=None) == (40, True)
    assert estimate_bytes((3, None, 5), 2, batch_size=16) == (30, True)
    assert estimate_bytes(None, 4, batch_size=16) == (4, True)
    assert estimate_bytes((3, 5), 8, batch_size=None) == (120, False)


def test_ops_between_gradient_ops_are_backward_even_outside_the_scope():
    # TensorFlow sums gradients with an AddN named outside gradient_tape/.
    ops = [
        op("x", "Placeholder", outputs=[f32(4, 4)]),
        op("f", "Relu", ["x:0"], [f32(4, 4)]),
        op("gradient_tape/g1", "Mul", ["f:0"], [f32(4, 4)]),
        op("gradient_tape/g2", "Mul", ["f:0"], [f32(4, 4)]),
        op("AddN_3", "AddN", ["gradient_tape/g1:0", "gradient_tape/g2:0"], [f32(4, 4)]),
        op("gradient_tape/g3", "Mul", ["AddN_3:0", "f:0"], [f32(4, 4)]),
        op("apply", "Mul", ["gradient_tape/g3:0"], [f32(4, 4)]),
        op("assign", "AssignSubVariableOp", ["apply:0"], []),
    ]
    m = GraphModel.from_ops(ops)
    assert m.phase("AddN_3") == "backward"
    assert m.phase("apply") == "update" and m.phase("assign") == "update"
    assert m.phase("f") == "forward"


def test_a_forward_loop_fed_by_gradient_scoped_accumulators_stays_forward():
    # while_v2 (an LSTM's loop): the forward While gets accumulator inputs, EmptyTensorList ops of
    # gradient-scoped constants and a forward length, made under gradient_tape/ when the gradient
    # is built. The forward While, and what reads it before the loss, are still forward.
    ops = [
        op("x", "Placeholder", outputs=[f32(8, 16)]),
        op("n", "Max", ["x:0"], [("int32", (), 4, False)]),
        op("gradient_tape/acc/shape", "Const", outputs=[("int32", (1,), 4, False)]),
        op("gradient_tape/acc", "EmptyTensorList", ["gradient_tape/acc/shape:0", "n:0"], [("variant", (), 0, False)]),
        op("rnn/while", "While", ["x:0", "gradient_tape/acc:0"], [f32(8, 16), ("variant", (), 0, False)]),
        op("dense", "MatMul", ["rnn/while:0"], [f32(8, 4)]),
        op("loss", "Sum", ["dense:0"], [f32(1)]),
        op("gradient_tape/dense_grad", "MatMul", ["loss:0", "rnn/while:0"], [f32(8, 16)]),
        op("gradient_tape/while_grad", "StatelessWhile", ["gradient_tape/dense_grad:0", "rnn/while:1"], [f32(8, 16)]),
        op("AddN", "AddN", ["gradient_tape/while_grad:0", "gradient_tape/dense_grad:0"], [f32(8, 16)]),
        op("gradient_tape/last", "Mul", ["AddN:0"], [f32(8, 16)]),
        op("update", "AssignSubVariableOp", ["gradient_tape/last:0"], []),
    ]
    model = GraphModel.from_ops(ops)
    phases = {n: model.phase(n) for n in model.dag}
    assert {n for n, p in phases.items() if p == "forward"} == {"x", "n", "rnn/while", "dense", "loss"}
    assert phases["gradient_tape/acc"] == phases["gradient_tape/acc/shape"] == "backward"  # by name
    assert phases["AddN"] == "backward" and phases["update"] == "update"


def _pushdown_case(**changes):
    """``p = (x * y) * c`` with ``x``, ``y`` of 8 floats; ``changes`` replace whole records by name."""
    records = {
        "c": op("c", "Const", outputs=[f32(1)]),
        "x": op("x", "Placeholder", outputs=[f32(8)]),
        "y": op("y", "Softmax", ["x:0"], [f32(8)]),
        "k": op("k", "Mul", ["x:0", "y:0"], [f32(8)]),
        "p": op("p", "Mul", ["k:0", "c:0"], [f32(8)]),
    }
    records.update(changes)
    return GraphModel.from_ops(records.values())


def test_constant_pushdown_follows_grapplers_conditions():
    pushed, pairs = with_constant_pushdown(_pushdown_case())
    assert pairs == [("p", "k")] and pushed.inputs_of["k"] == ["c:0", "y:0"] and pushed.inputs_of["p"] == ["x:0", "k:0"]
    # The original model is left as it was.
    assert _pushdown_case().inputs_of["k"] == ["x:0", "y:0"]
    # X is the child's first input unless that one is a constant.
    _, pairs = with_constant_pushdown(_pushdown_case(k=op("k", "Mul", ["c2:0", "y:0"], [f32(8)]),
                                                      c2=op("c2", "Const", outputs=[f32(1)])))  # fmt: skip
    assert pairs == [("p", "k")]
    not_pushed = {
        "another family": {"k": op("k", "AddV2", ["x:0", "y:0"], [f32(8)])},
        "a child read twice": {"q": op("q", "Relu", ["k:0"], [f32(8)])},
        "another device": {
            "y": op("y", "Softmax", ["x:0"], [f32(8)], device="/device:CPU:0"),
            "k": op("k", "Mul", ["x:0", "y:0"], [f32(8)], device="/device:CPU:1"),
        },
        "a constant larger than X": {"c": op("c", "Const", outputs=[f32(16)])},
        "half precision": {"k": op("k", "Mul", ["x:0", "y:0"], [("float16", (8,), 16, False)])},
        "no constant": {"c": op("c", "Placeholder", outputs=[f32(1)])},
    }
    for why, changes in not_pushed.items():
        model = _pushdown_case(**changes)
        assert with_constant_pushdown(model) == (model, []), why


def test_constant_pushdown_repeats_until_nothing_changes():
    """``c * (x * (y * z))``: the constant goes down twice, to ``y``'s product with ``z``... as Grappler's
    loop does, then no further (``y * z`` has no constant child)."""
    model = chained_pushdown_model()
    pushed, pairs = with_constant_pushdown(model)
    assert pairs == [("p", "k"), ("k", "yz")]
    assert pushed.inputs_of["p"] == ["x:0", "k:0"]
    assert pushed.inputs_of["k"] == ["y:0", "yz:0"] and pushed.inputs_of["yz"] == ["c:0", "z:0"]
