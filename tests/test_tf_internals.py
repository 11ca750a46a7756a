"""Pins on the TensorFlow behaviour tflms relies on (TF 2.21). A failure here after a
TensorFlow upgrade points at tflms/_tf_internal.py."""

import numpy as np
import pytest
import tensorflow as tf

from tflms import _tf_internal as tfi

import zoo

pytestmark = pytest.mark.integration


def test_tape_gradients_are_under_gradient_tape_scope():
    _, step = zoo.tiny_step()
    graph = step.get_concrete_function(tf.TensorSpec((4, 8)), tf.TensorSpec((4, 1))).graph
    types = {op.type: op.name for op in graph.get_operations()}
    assert types["ReluGrad"].startswith("gradient_tape/")
    assert not types["Relu"].startswith("gradient_tape/")
    assert "AssignSubVariableOp" in types


def test_copy_and_rebuild_give_an_equal_independent_function():
    model, step = zoo.tiny_step()
    x, y = tf.ones((4, 8)), tf.zeros((4, 1))
    cf = step.get_concrete_function(x, y)
    copy = tfi.copy_graph(cf)
    assert copy is not cf.graph
    assert sorted(op.name for op in copy.get_operations() if op.type != "Placeholder") == sorted(
        op.name for op in cf.graph.get_operations() if op.type != "Placeholder"
    )
    assert len(copy.captures) == len(cf.graph.captures)
    new_cf = tfi.rebuild(cf, copy)
    initial = [v.numpy() for v in model.weights]
    a = [float(cf(x, y)) for _ in range(2)]
    for v, value in zip(model.weights, initial):
        v.assign(value)
    b = [float(new_cf(x, y)) for _ in range(2)]
    assert a == b and a[0] != a[1]


def test_grappler_removes_unmarked_swap_identities():
    """Why swap ops carry _grappler_do_not_remove: without it Grappler deletes them."""
    _, step = zoo.tiny_step()
    cf = step.get_concrete_function(tf.ones((4, 8)), tf.zeros((4, 1)))
    graph = tfi.copy_graph(cf)
    relu = next(op for op in graph.get_operations() if op.type == "Relu").outputs[0]
    grad = next(op for op in graph.get_operations() if op.type == "ReluGrad")
    with graph.as_default():
        with tf.device("/device:CPU:0"):
            out = tf.identity(relu, name="probe_out")
        with tf.device("/device:CPU:1"):
            back = tf.identity(out, name="probe_in")
    index = [t.name for t in grad.inputs].index(relu.name)
    tfi.update_input(grad, index, back)
    names = {n.name for n in tfi.grappler_optimize(tfi.rebuild(cf, graph), "/device:CPU:1").node}
    assert "probe_in" not in names and "probe_out" not in names
    # Marked with the attribute, both survive.
    for name in ("probe_in", "probe_out"):
        tfi.set_attr(graph.get_operation_by_name(name), "_grappler_do_not_remove", True)
    names = {n.name for n in tfi.grappler_optimize(tfi.rebuild(cf, graph), "/device:CPU:1").node}
    assert {"probe_in", "probe_out"} <= names


def test_grappler_pushes_constants_down_as_the_simulator_assumes():
    """Rule 0 of the simulator (:func:`tflms.ir.graph.with_constant_pushdown`) against the graphs
    the runtime ran for the transformer of the test bed.

    Plain step: in every pair it rewrites, the runtime's inner op no longer reads the
    gradient the rule moves out (or is gone), and the attention gradients' scaled softmax
    is computed from the softmax. Rewritten step: where a swap-in feeds the attention's
    inner op, Grappler pairs the constant as in the plain step, with the swapped-in softmax,
    whose landing is named under the softmax (:func:`tflms.rewrite.apply.landing_name`). With
    the landing named ``tflms_landing/...`` (before 2026-11-25) it paired the constant with
    the gradient. If a TensorFlow upgrade changes either, this fails."""
    import tflms
    from tflms.emulate.grappler import with_constant_pushdown
    from tflms.ir.graph import GraphModel
    from tflms.rewrite.apply import is_landing
    from tflms.testing.zoo import build

    from conftest import DEVICE, HOST

    _, x, y, train_step = build("transformer", 2, size=16)
    cf = tf.function(train_step).get_concrete_function(x, y)
    traced = GraphModel.from_func_graph(cf.graph)
    pushed, pairs = with_constant_pushdown(traced)

    def ran(step):
        def call():
            with tf.device(DEVICE):
                step(x, y)

        graphs = tfi.ran_graphs(call)
        return {n.name: [i.split(":")[0] for i in n.input if not i.startswith("^")] for g in graphs for n in g.node}

    def moved_op(parent, child):
        (moved,) = [t for t in pushed.inputs_of[parent] if not t.startswith(child + ":")]
        assert moved in traced.inputs_of[child]
        return moved.rsplit(":", 1)[0]

    # Two blocks, each: the attention's scale into the softmax gradient, and three in GELU's gradient.
    assert len(pairs) == 8
    plain = ran(cf)
    attention = 0
    for parent, child in pairs:
        assert moved_op(parent, child) not in plain.get(child, []), (parent, child)
        softmax = [t.rsplit(":", 1)[0] for t in pushed.inputs_of[child] if "Softmax" in t]
        if softmax:
            attention += 1
            assert softmax[0] in plain[child] and traced.phase(softmax[0]) == "forward"
    assert attention == 2

    new_cf, plan = tflms.optimize(cf, device=DEVICE, host=HOST, knobs=tflms.Knobs(min_bytes=1024))
    fed = {c for s in plan.swaps for si in s.swap_ins for c, _ in si.consumers}
    swapped = [(p, c) for p, c in pairs if c in fed and any("Softmax" in t for t in traced.inputs_of[c])]
    assert swapped
    rewritten = ran(new_cf)
    # The attention pairs (GELU's chain is folded further, its second product into a constant).
    for parent, child in swapped:
        assert moved_op(parent, child) not in rewritten[child], (parent, child)
        (softmax,) = [t.rsplit(":", 1)[0] for t in traced.inputs_of[child] if "Softmax" in t]
        (landing,) = [t for t in rewritten[child] if is_landing(t)]
        assert landing.startswith(softmax + "/"), (child, rewritten[child])


def test_grappler_removes_the_optimizers_identity_n_and_updates_start_before_the_last_gradient():
    """Keras 3's optimizer passes every gradient through one ``IdentityN``, so in the traced step
    every update op waits for all gradients. Grappler removes it: the graphs the runtime ran have
    none, and a profiled step starts an update that reads a gradient before the last backward op.
    :func:`tflms.testing.measure.recorded_order` follows the runtime here; the simulator's own schedule
    keeps the ``IdentityN`` as a barrier (see the README's limits). If a TensorFlow or Keras
    upgrade changes either, this fails."""
    from tflms.ir.graph import GraphModel
    from tflms.testing.zoo import build

    from conftest import DEVICE

    model, x, y, train_step = build("cnn", 4, size=16)
    cf = tf.function(train_step).get_concrete_function(x, y)
    traced = GraphModel.from_func_graph(cf.graph)
    (identity_n,) = [n for n, t in traced.dag.nodes(data="type") if t == "IdentityN"]
    assert len(traced.outputs_of[identity_n]) == 2 * len(model.trainable_variables)  # gradients and variables
    updates = {c for t in traced.outputs_of[identity_n] for c, _ in traced.tensors[t].consumers}
    assert updates and all(traced.phase(op) == "update" for op in updates)

    def call():
        with tf.device(DEVICE):
            cf(x, y)

    assert not [n.name for g in tfi.ran_graphs(call) for n in g.node if n.op == "IdentityN"]
    _, kernels = tfi.profile_step(call)
    started = [k["op"] for k in kernels]
    first_update = min(i for i, op in enumerate(started) if op in updates)
    last_backward = max(i for i, op in enumerate(started) if op in traced.dag and traced.phase(op) == "backward")
    assert first_update < last_backward, (started[first_update], started[last_backward])


def test_grappler_rewrites_a_large_addn_into_an_accumulation_unless_the_memory_optimizer_is_manual():
    """Grappler's memory optimizer (default level) turns an AddN of more than two inputs whose
    estimated peak exceeds 80 % of the device's memory (a CPU device reports 256 MiB) into a
    TemporaryVariable, AssignAdds and a Const of zeros the size of the sum, which the function
    then holds in device memory; tflms.manual_memory_optimizer() keeps the AddN."""
    import tflms

    from conftest import DEVICE

    x = tf.reshape(tf.range(20000 * 1024, dtype=tf.float32), (20000, 1024)) * 1e-7  # 78 MiB

    def make():
        @tf.function
        def total(x):
            return tf.math.add_n([tf.sin(x), tf.cos(x), tf.tanh(x)])

        return total

    def ran(fn):
        def call():
            with tf.device(DEVICE):
                out.append(fn(x).numpy())

        return [n for g in tfi.ran_graphs(call) for n in g.node]

    out = []
    default = ran(make())
    zeros = [n for n in default if n.name.endswith("/tmp_var_zeros")]
    assert {n.op for n in default} >= {"TemporaryVariable", "AssignAdd", "DestroyTemporaryVariable"}
    assert [n.op for n in zeros] == ["Const"]
    assert [d.size for d in zeros[0].attr["value"].tensor.tensor_shape.dim] == [20000, 1024]
    with tflms.manual_memory_optimizer():
        manual = ran(make())
    assert "AddN" in {n.op for n in manual} and not {"TemporaryVariable", "AssignAdd"} & {n.op for n in manual}
    expected = (tf.sin(x) + tf.cos(x) + tf.tanh(x)).numpy()
    np.testing.assert_array_equal(out[1], expected)  # the AddN sums left to right
    np.testing.assert_allclose(out[0], expected, rtol=1e-6)


def _terms(xs, names):
    return [tf.math.multiply(x, 1.0 + i, name=name) for i, (x, name) in enumerate(zip(xs, names))]


def _chain(terms, tag=True):
    """The sum of ``terms`` as tflms.plan.passes.sums builds it: AddV2 ops in the AddN kernel's groups."""
    from tflms.plan.passes.sums import ADD_OPS_TAG, kernel_groups

    def add(a, b):
        out = tf.raw_ops.AddV2(x=a, y=b)
        if tag:
            tfi.set_attr(out.op, ADD_OPS_TAG, True)
        return out

    total = None
    for group in kernel_groups(len(terms)):
        part = terms[group[0]]
        for i in group[1:]:
            part = add(part, terms[i])
        total = part if total is None else add(total, part)
    return total


def test_an_addn_sums_like_tflms_chain_over_its_inputs_sorted_by_name():
    """What split_sums relies on for bit-identity (tflms.plan.passes.sums): Grappler sorts an AddN's inputs
    by name, and the AddN kernel adds them in kernel_groups' association. The chain over the
    terms in graph order rounds differently."""
    from tflms.plan.passes.sums import term_order

    rng = np.random.default_rng(1)
    names = ["zeta", "alpha", "mid", "beta", "omega", "gamma", "aa", "zz", "k", "b2", "b10", "q"]
    for n in (4, 11):
        xs = [
            tf.constant(rng.standard_normal((256, 1024)).astype(np.float32) * 10 ** rng.uniform(-4, 4))
            for _ in range(n)
        ]
        sorted_names = [t[:-2] for t in term_order([f"{name}:0" for name in names[:n]])]

        def by_name(ts, order=tuple(sorted_names)):
            return [dict(zip(names, ts))[name] for name in order]

        plain = tf.function(lambda *xs: tf.math.add_n(_terms(xs, names)))(*xs).numpy()
        chain = tf.function(lambda *xs: _chain(by_name(_terms(xs, names))))(*xs).numpy()
        graph_order = tf.function(lambda *xs: _chain(_terms(xs, names)))(*xs).numpy()
        np.testing.assert_array_equal(chain, plain)
        assert not np.array_equal(graph_order, plain)


def test_grappler_folds_an_add_chain_into_one_addn_unless_its_ops_carry_the_tag():
    """Grappler's AddOpsRewrite turns a chain of AddV2 into one AddN, and leaves alone the ops
    that carry tflms.plan.passes.sums.ADD_OPS_TAG (the mark it puts on what it has rewritten)."""

    def ran(tag):
        fn = tf.function(lambda *xs: tf.reduce_sum(_chain([tf.exp(x) for x in xs], tag=tag)))
        x = [tf.ones((100, 100))] * 4
        return sorted(n.op for g in tfi.ran_graphs(lambda: fn(*x)) for n in g.node if n.op in ("AddN", "AddV2"))

    assert ran(tag=False) == ["AddN"]
    assert ran(tag=True) == ["AddV2"] * 3


def test_onednn_runs_a_filter_gradient_and_its_bias_gradient_as_one_kernel_unless_a_path_joins_them():
    """Why no order or trigger of a plan joins a ``Conv2DBackpropFilter`` and the ``BiasAddGrad``
    of the same gradient (tflms.ir.graph.fused_partners): oneDNN's graph pass runs the two as one
    kernel, and with a control edge between them each runs alone, the bias gradient computed by
    another kernel. Asserted: which kernels ran, the same filter gradient, and the same bias
    gradient within float32 rounding. Whether the two kernels' bias sums agree bit for bit depends
    on the CPU (they rounded apart on the machine tflms is developed on), so a plan that split
    them would only keep a step bit-identical on some CPUs: the rule keeps them together."""
    import os
    import platform

    import pytest

    if os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "0" or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("oneDNN's x86 kernels are off here: nothing fuses the two")
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((8, 32, 32, 16)).astype(np.float32))
    dy = tf.constant(rng.standard_normal((8, 32, 32, 32)).astype(np.float32))

    def ran(joined):
        @tf.function
        def gradients(x, dy):
            dy = dy * 1.0001  # made in the function, as a step's gradient is
            sizes = tf.constant([3, 3, 16, 32])
            bias = tf.raw_ops.BiasAddGrad(out_backprop=dy)
            with tf.control_dependencies([bias] if joined else []):
                filt = tf.raw_ops.Conv2DBackpropFilter(
                    input=x, filter_sizes=sizes, out_backprop=dy, strides=[1, 1, 1, 1], padding="SAME"
                )
            return filt, bias

        out = []
        ops = {n.op for g in tfi.ran_graphs(lambda: out.extend(t.numpy() for t in gradients(x, dy))) for n in g.node}
        return ops, out

    fused_ops, (filt, bias) = ran(joined=False)
    apart_ops, (filt_apart, bias_apart) = ran(joined=True)
    # If this fails after a TensorFlow upgrade, oneDNN no longer fuses the two and the rule
    # (tflms.ir.graph.fused_partners) may go.
    assert any(op.endswith("Conv2DBackpropFilterWithBias") for op in fused_ops), sorted(fused_ops)
    assert "BiasAddGrad" in apart_ops and not any(op.endswith("WithBias") for op in apart_ops)
    np.testing.assert_array_equal(filt_apart, filt)
    # Two sums of the same 8192 terms per channel, in orders that differ by kernel: 1e-6 of the sum
    # of their magnitudes (6.7e-3 here) is 20 times what float32 rounding moved them here (3e-4).
    np.testing.assert_allclose(
        bias_apart, bias, rtol=0, atol=1e-6 * float(np.abs(dy.numpy()).sum(axis=(0, 1, 2)).max())
    )
