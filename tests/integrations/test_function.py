"""@tflms.function and tflms.optimize on unusual and bad input."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tflms
from tflms import Knobs, LMSConfig, LMSWarning
from tflms.emulate.order import ready_order

import zoo
from conftest import DEVICE, HOST, SMALL, SMALL_KNOBS
from helpers import check_structure, check_survives_grappler, swap_ops

pytestmark = pytest.mark.integration

# What tflms does on a machine without a GPU; on a GPU machine there is none to miss.
without_gpu = pytest.mark.skipif(
    bool(tf.config.list_physical_devices("GPU")), reason="tests the no-GPU path; this machine has a GPU"
)


@pytest.fixture(scope="module")
def mlp():
    return zoo.mlp()


def test_decorator_forms_give_the_same_plan(mlp):
    fn = mlp.step_fn()
    bare = tflms.function(fn)
    assert isinstance(bare, tflms.LMSFunction) and bare.config == LMSConfig()

    @tflms.function(device=DEVICE, knobs=tflms.Knobs(swapout_threshold=5))
    def step(x, y):
        return fn(x, y)

    cfg = LMSConfig(device=DEVICE, knobs=Knobs(swapout_threshold=5))
    a = tflms.function(fn, config=cfg)
    b = tflms.function(tf.function(fn), config=cfg)
    c = tflms.function(config=cfg)(fn)
    plans = {f.get_plan(mlp.x, mlp.y).to_json() for f in (a, b, c)}
    assert len(plans) == 1
    # Names of the wrapper differ, the swaps do not.
    assert [s.tensor for s in step.get_plan(mlp.x, mlp.y).swaps] == [s.tensor for s in a.get_plan(mlp.x, mlp.y).swaps]


def test_one_rewritten_function_per_signature(mlp):
    lms = tflms.function(mlp.step_fn(), device=DEVICE, **SMALL)
    cf1 = lms.get_concrete_function(mlp.x, mlp.y)
    assert lms.get_concrete_function(mlp.x, mlp.y) is cf1
    assert lms.get_plan(mlp.x, mlp.y) is lms.get_plan(mlp.x, mlp.y)
    x2, y2 = mlp.x[:32], mlp.y[:32]
    cf2 = lms.get_concrete_function(x2, y2)
    assert cf2 is not cf1
    assert lms.get_plan(x2, y2).swaps[0].bytes == lms.get_plan(mlp.x, mlp.y).swaps[0].bytes // 2
    assert len(lms.plans) == 2


def test_optimize_leaves_the_original_alone_and_is_idempotent(mlp):
    cf = tf.function(mlp.step_fn()).get_concrete_function(mlp.x, mlp.y)
    n_ops = len(cf.graph.get_operations())
    new_cf, plan = tflms.optimize(cf, device=DEVICE, **SMALL)
    assert new_cf is not cf and len(plan.swaps) >= 1
    assert len(cf.graph.get_operations()) == n_ops and swap_ops(cf.graph) == ([], [])
    again, plan2 = tflms.optimize(new_cf, device=DEVICE, **SMALL)
    assert again is new_cf and plan2 is plan
    # Recognised from the graph alone too (not only through the registry).
    from tflms import _tf_internal as tfi

    copy = tfi.rebuild(new_cf, tfi.copy_graph(new_cf))
    same, plan3 = tflms.optimize(copy, device=DEVICE, **SMALL)
    assert same is copy and plan3.swaps == () and "already rewritten" in plan3.reason
    with pytest.raises(TypeError, match="ConcreteFunction"):
        tflms.optimize(mlp.step_fn())


def test_a_plan_of_orders_only_is_applied_and_recognised(mlp):
    """A budget met by ordering edges alone (``serialize=True``) gives a plan with orders and no
    swaps: the rewrite applies them, marks the step rewritten, and the numbers stay the same."""
    import dataclasses

    import networkx as nx

    from tflms import _tf_internal as tfi
    from tflms.ir.graph import GraphModel
    from tflms.rewrite.apply import apply_plan, is_rewritten

    cf = tf.function(mlp.step_fn()).get_concrete_function(mlp.x, mlp.y)
    model = GraphModel.from_func_graph(cf.graph)
    backward = [op for op in ready_order(model) if model.phase(op) == "backward" and model.dag.in_degree(op)]
    # The last backward op that the schedule runs before another one it does not lead to.
    op, after = next((a, b) for a, b in zip(backward[::-1][1:], backward[::-1]) if not nx.has_path(model.dag, a, b))
    empty = tflms.make_plan(model, LMSConfig(knobs=Knobs(n_tensors=0)))
    plan = dataclasses.replace(empty, orders=(tflms.Order(op=op, after=after),), reason="")
    graph = tfi.copy_graph(cf)
    assert apply_plan(graph, plan, DEVICE, HOST)["order"] == 1
    ordered = tfi.rebuild(cf, graph)
    assert not is_rewritten(cf.graph) and is_rewritten(ordered.graph)
    assert after in [c.name for c in ordered.graph.get_operation_by_name(op).control_inputs]
    same, again = tflms.optimize(ordered, device=DEVICE, **SMALL)
    assert same is ordered and again.orders == () and "already rewritten" in again.reason
    losses, weights = zoo.run_steps(mlp, cf, n=2)
    losses_ordered, weights_ordered = zoo.run_steps(mlp, ordered, n=2)
    np.testing.assert_array_equal(losses_ordered, losses)
    for a, b in zip(weights_ordered, weights, strict=True):
        np.testing.assert_array_equal(a, b)


@without_gpu
def test_no_gpu_and_no_device_plans_but_skips_rewrite_with_a_warning(mlp):
    assert not tf.config.list_logical_devices("GPU")
    fn = mlp.step_fn()
    lms = tflms.function(fn, **SMALL)
    with pytest.warns(LMSWarning, match="no GPU found and no `device`") as record:
        losses, variables = zoo.run_steps(mlp, lms, n=2)
    assert len(record) == 1
    plan = lms.get_plan(mlp.x, mlp.y)
    assert len(plan.swaps) >= 1
    assert swap_ops(lms.get_concrete_function(mlp.x, mlp.y).graph) == ([], [])
    ref_losses, ref_vars = zoo.run_steps(mlp, tf.function(fn), n=2)
    np.testing.assert_array_equal(losses, ref_losses)


def test_inference_function_is_left_unchanged(mlp):
    model = mlp.model

    @tflms.function(device=DEVICE)
    def predict(x):
        return model(x, training=False)

    plan = predict.get_plan(mlp.x)
    assert plan.swaps == () and "no backward ops" in plan.reason
    cf = predict.get_concrete_function(mlp.x)
    assert swap_ops(cf.graph) == ([], [])
    np.testing.assert_array_equal(predict(mlp.x).numpy(), model(mlp.x, training=False).numpy())


def test_a_trace_of_unknown_sizes_is_sized_from_the_call_or_batch_size(mlp):
    """With an ``input_signature`` of unknown batch, the trace is planned for the sizes of the call
    that made it (no warning); planned from specs alone (no call), it sizes the unknown batch as
    ``batch_size``, and without one as 1, with a warning that names the inputs."""
    fn = mlp.step_fn()
    spec = [tf.TensorSpec((None, 64), tf.float32), tf.TensorSpec((None,), tf.int32)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", LMSWarning)
        called = tflms.function(fn, input_signature=spec, device=DEVICE, **SMALL).get_plan(mlp.x, mlp.y)
        given = tflms.function(
            fn, input_signature=spec, device=DEVICE, knobs=SMALL_KNOBS.replace(batch_size=64)
        ).get_plan(*spec)
    small = tflms.function(fn, input_signature=spec, device=DEVICE, **SMALL)
    with pytest.warns(LMSWarning, match=r"unknown size \(x: float32\[\?, 64\]; y: int32\[\?\]\).*batch_size=1"):
        p_small = small.get_plan(*spec)
    # With batch 1 the 256-float activations (1 KiB) are below min_bytes; with 64 they qualify.
    assert p_small.swaps == ()
    for plan in (called, given):
        assert len(plan.swaps) >= 1 and plan.swaps[0].bytes == 64 * 256 * 4
    assert called.swaps[0].shape[0] == 64 and given.swaps[0].shape[0] is None
    big = tflms.function(fn, input_signature=spec, device=DEVICE, **SMALL)
    losses, variables = zoo.run_steps(mlp, big, n=2)
    ref_losses, ref_vars = zoo.run_steps(mlp, tf.function(fn), n=2)
    assert big.plans[0].swaps
    np.testing.assert_array_equal(losses, ref_losses)
    for a, b in zip(variables, ref_vars):
        np.testing.assert_array_equal(a, b)


def test_control_flow_bodies_are_not_rewritten():
    keras.utils.set_random_seed(7)
    dense = [keras.layers.Dense(128, activation="relu") for _ in range(4)]
    head = keras.layers.Dense(1)
    opt = keras.optimizers.SGD(0.01)
    x = tf.random.stateless_normal((32, 128), seed=[1, 2])

    def fn(x, flag):
        with tf.GradientTape() as tape:
            h = x
            for layer in dense:
                h = layer(h)
            h = tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, tf.tanh(h) * 1.5), (0, h))[1]
            h = tf.cond(flag, lambda: h * 2.0, lambda: h - 1.0)
            loss = tf.reduce_mean(head(h) ** 2)
        variables = [v for layer in dense + [head] for v in layer.trainable_variables]
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    flag = tf.constant(True)
    for layer in dense:
        layer(x)
    head(dense[-1](dense[-1](x)) * 0 + x)
    variables = [v for layer in dense + [head] for v in layer.variables] + list(opt.variables)
    opt.build([v for layer in dense + [head] for v in layer.trainable_variables])
    variables = [v for layer in dense + [head] for v in layer.variables] + list(opt.variables)
    initial = [v.numpy() for v in variables]

    def run(step):
        for v, value in zip(variables, initial):
            v.assign(value)
        with tf.device(DEVICE):
            losses = [step(x, flag).numpy() for _ in range(3)]
        return losses, [v.numpy() for v in variables]

    plain = tf.function(fn)
    lms = tflms.function(fn, device=DEVICE, knobs=SMALL_KNOBS.replace(swapout_threshold=5))
    ref = run(plain)
    got = run(lms)
    np.testing.assert_array_equal(got[0], ref[0])
    for a, b in zip(got[1], ref[1]):
        np.testing.assert_array_equal(a, b)
    plan = lms.get_plan(x, flag)
    assert len(plan.swaps) >= 1
    check_structure(lms.get_concrete_function(x, flag), plan, DEVICE, HOST)
    # Rewrite the plain trace itself, to compare bodies with the very functions it had.
    original = plain.get_concrete_function(x, flag)
    cf, plan = tflms.optimize(original, device=DEVICE, knobs=SMALL_KNOBS.replace(swapout_threshold=5))
    check_structure(cf, plan, DEVICE, HOST)
    check_survives_grappler(cf, DEVICE)
    cf_types = ("While", "StatelessWhile", "If", "StatelessIf")
    control_flow = [op for op in cf.graph.get_operations() if op.type in cf_types]
    assert len(control_flow) >= 2
    checked = 0
    for op in control_flow:
        for attr in ("body", "cond", "then_branch", "else_branch"):
            if attr in op.node_def.attr:
                fname = op.get_attr(attr).name
                fdef = cf.graph._functions[fname].cached_definition  # noqa: SLF001
                assert fdef == original.graph._functions[fname].cached_definition  # noqa: SLF001
                assert not any(n.name.startswith("tflms") for n in fdef.node_def)
                checked += 1
    assert checked >= 4


def test_invalid_options_raise_at_decoration():
    with pytest.raises(ValueError, match=r"swapout_threshold=-1"):
        tflms.function(lambda x: x, knobs=tflms.Knobs(swapout_threshold=-1))
    with pytest.raises(ValueError, match=r"device='/device:FOO:0'"):
        tflms.function(lambda x: x, device="/device:FOO:0")
    with pytest.raises(ValueError, match=r"incl_types=.*NoSuchOp"):
        tflms.function(lambda x: x, knobs=tflms.Knobs(incl_types=["NoSuchOp"]))
    with pytest.raises(TypeError, match="Unknown LMS option"):
        tflms.function(lambda x: x, swap_threshold=3)


def test_missing_device_raises_naming_it(mlp):
    lms = tflms.function(mlp.step_fn(), device="/device:GPU:3")
    with pytest.raises(ValueError, match=r"device='/device:GPU:3'.*does not exist|does not exist.*GPU:3"):
        lms(mlp.x, mlp.y)


def test_eager_mode_runs_without_lms_and_warns_once(mlp):
    fn = mlp.step_fn()
    lms = tflms.function(fn, device=DEVICE)
    tf.config.run_functions_eagerly(True)
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            losses, _ = zoo.run_steps(mlp, lms, n=2)
        ref, _ = zoo.run_steps(mlp, fn, n=2)
    finally:
        tf.config.run_functions_eagerly(False)
    eager_warnings = [w for w in record if issubclass(w.category, LMSWarning)]
    assert len(eager_warnings) == 1 and "eagerly" in str(eager_warnings[0].message)
    np.testing.assert_array_equal(losses, ref)


def test_method_decoration_binds_per_instance():
    keras.utils.set_random_seed(8)

    class Trainer:
        def __init__(self):
            self.model = keras.Sequential(
                [
                    keras.Input((64,)),
                    keras.layers.Dense(512, activation="relu"),
                    keras.layers.Dense(512, activation="relu"),
                    keras.layers.Dense(1),
                ]
            )
            self.opt = keras.optimizers.SGD(0.01)

        @tflms.function(device=DEVICE, knobs=SMALL_KNOBS.replace(swapout_threshold=3))
        def step(self, x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(self.model(x) ** 2)
            grads = tape.gradient(loss, self.model.trainable_variables)
            self.opt.apply_gradients(zip(grads, self.model.trainable_variables))
            return loss

    t1, t2 = Trainer(), Trainer()
    x = tf.ones((16, 64))
    assert t1.step is t1.step and t1.step is not t2.step
    assert float(t1.step(x)) > 0
    assert len(t1.step.get_plan(x).swaps) >= 1


def test_optimize_in_place_edits_the_given_graph_only_when_asked(mlp):
    fn = mlp.step_fn()
    cf = tf.function(fn).get_concrete_function(mlp.x, mlp.y)
    new_cf, plan = tflms.optimize(cf, device=DEVICE, copy=False, **SMALL)
    assert new_cf is not cf and new_cf.graph is cf.graph
    check_structure(new_cf, plan, DEVICE, HOST)
    # The given function keeps running the plain step it was built from.
    plain_losses, plain_vars = zoo.run_steps(mlp, cf, n=2)
    lms_losses, lms_vars = zoo.run_steps(mlp, new_cf, n=2)
    np.testing.assert_array_equal(lms_losses, plain_losses)
    for a, b in zip(lms_vars, plain_vars):
        np.testing.assert_array_equal(a, b)


@without_gpu
def test_no_device_warning_points_at_the_callers_line(mlp):
    """Whichever entry point plans, the warning names the user's file, not tflms's."""
    cf = tf.function(mlp.step_fn()).get_concrete_function(mlp.x, mlp.y)
    calls = [
        lambda: tflms.optimize(cf, **SMALL),
        lambda: tflms.function(mlp.step_fn(), **SMALL)(mlp.x, mlp.y),
        lambda: tflms.function(mlp.step_fn(), **SMALL).get_plan(mlp.x, mlp.y),
    ]
    for call in calls:
        with pytest.warns(LMSWarning, match="no GPU found") as record:
            call()
        assert [w.filename for w in record] == [__file__]


def test_xla_steps_are_refused_not_silently_dropped(mlp):
    xla = tf.function(mlp.step_fn(), jit_compile=True)
    with pytest.raises(ValueError, match="XLA would drop the swap ops.*jit_compile=True"):
        tflms.function(xla, device=DEVICE)
    cf = xla.get_concrete_function(mlp.x, mlp.y)
    with pytest.raises(ValueError, match="XLA would drop the swap ops.*jit_compile=True"):
        tflms.optimize(cf, device=DEVICE)
    # Without XLA the same step is rewritten.
    new_cf, plan = tflms.optimize(
        tf.function(mlp.step_fn()).get_concrete_function(mlp.x, mlp.y), device=DEVICE, **SMALL
    )
    assert plan.swaps and swap_ops(new_cf.graph)[0]


def test_plans_are_shown_with_their_input_signature(mlp):
    lms = tflms.function(mlp.step_fn(), device=DEVICE)
    lms.get_plan(mlp.x, mlp.y)
    lms.get_plan(mlp.x[:32], mlp.y[:32])
    by_sig = lms.plans_by_signature
    assert list(by_sig) == ["x: float32[64, 64], y: int32[64]", "x: float32[32, 64], y: int32[32]"]
    assert list(by_sig.values()) == lms.plans


def test_signatures_that_differ_in_a_python_argument_are_told_apart(mlp):
    """A step with a Python argument (Horovod's example passes ``first_batch`` as a bool) is
    traced once per value: each trace keeps its own entry."""
    step = mlp.step_fn()

    def train(x, y, first_batch):
        return step(x, y)

    lms = tflms.function(train, device=DEVICE)
    lms.get_plan(mlp.x, mlp.y, True)
    lms.get_plan(mlp.x, mlp.y, False)
    by_sig = lms.plans_by_signature
    assert list(by_sig) == [
        "x: float32[64, 64], y: int32[64], first_batch=True",
        "x: float32[64, 64], y: int32[64], first_batch=False",
    ]
    assert list(by_sig.values()) == lms.plans


def test_misspelled_option_lists_the_valid_ones_everywhere():
    for make in (lambda: LMSConfig(budjet="1GiB"), lambda: tflms.function(lambda x: x, budjet="1GiB")):
        with pytest.raises(TypeError, match=r"Unknown LMS option\(s\): budjet\. Options: budget, .*Received: budjet="):
            make()


@without_gpu
def test_missing_cpu_device_says_how_to_make_one(mlp):
    with pytest.raises(ValueError, match=r"no GPU.*set_logical_device_configuration.*device='/device:CPU:1'"):
        tflms.function(mlp.step_fn(), device="/device:CPU:7").get_plan(mlp.x, mlp.y)


def test_steps_are_called_with_a_manual_memory_optimizer_unless_configured_otherwise():
    """tflms.function calls its step with Grappler's memory optimizer at MANUAL, so a large
    AddN stays an AddN (at the default level Grappler makes it an accumulation with a constant
    of zeros held in device memory: tests/test_tf_internals.py); manual_memory_optimizer=False
    leaves TensorFlow's default, and a level the caller set is kept."""
    from tflms import _tf_internal as tfi

    from helpers import ACCUMULATION, ran_op_types

    x = tf.reshape(tf.range(20000 * 1024, dtype=tf.float32), (20000, 1024)) * 1e-7  # 78 MiB

    def total(x):
        return tf.math.add_n([tf.sin(x), tf.cos(x), tf.tanh(x)])

    def ran(**options):
        step = tflms.function(total, device=DEVICE, **options)
        out = []
        ops = ran_op_types(lambda: out.append(step(x).numpy()))
        return ops, out[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LMSWarning)  # nothing to swap in a forward-only step
        manual, y = ran()
        default, _ = ran(manual_memory_optimizer=False)
        with tfi.memory_optimization("SCHEDULING_HEURISTICS"):  # as a caller may set it
            kept, _ = ran()
    assert "AddN" in manual and not ACCUMULATION & manual
    np.testing.assert_array_equal(y, (tf.sin(x) + tf.cos(x) + tf.tanh(x)).numpy())
    assert ACCUMULATION <= default
    assert ACCUMULATION <= kept
    with pytest.raises(ValueError, match="manual_memory_optimizer must be True or False. Received: .*='yes'"):
        tflms.function(total, manual_memory_optimizer="yes")
    with pytest.raises(TypeError, match="manual_memory_optimizer=False is a setting of how a rewritten step is called"):
        LMSConfig(manual_memory_optimizer=False)  # a setting of the call, not of the plan


def test_steps_are_called_with_the_layout_optimizer_off_unless_configured_otherwise():
    """tflms.function calls a step it rewrote with Grappler's layout optimizer off where it would
    convert: on a GPU its transposes are buffers the plan does not count (README, "Grappler's
    layout optimizer"). On a CPU it converts only where the caller asks for it
    (``cpu_layout_conversion``), as here: an NCHW convolution then runs as NHWC between
    Transposes, unless tflms turns the optimizer off (without the ask, tflms leaves it:
    tests/test_layout_unet3d.py). ``layout_optimizer=True`` leaves TensorFlow's setting, and so does a
    layout optimizer the caller turned on explicitly, and a step tflms did not rewrite."""
    from tensorflow.core.protobuf import rewriter_config_pb2

    from tflms._tf_internal import rewrite_options

    from helpers import ran_op_types

    toggle, nchw_to_nhwc = rewriter_config_pb2.RewriterConfig, rewriter_config_pb2.RewriterConfig.NCHW_TO_NHWC
    x = tf.sin(tf.reshape(tf.range(4 * 3 * 16 * 16, dtype=tf.float32), (4, 3, 16, 16)))

    def ran(options, forward_only=False, plain=False, **caller):
        w1 = tf.Variable(tf.cos(tf.reshape(tf.range(3 * 3 * 3 * 8, dtype=tf.float32), (3, 3, 3, 8))) * 0.1)
        w2 = tf.Variable(tf.sin(tf.reshape(tf.range(3 * 3 * 8 * 8, dtype=tf.float32), (3, 3, 8, 8))) * 0.1)

        def forward(x):
            h = tf.nn.relu(tf.nn.conv2d(x, w1, 1, "SAME", data_format="NCHW"))
            return tf.reduce_sum(tf.nn.relu(tf.nn.conv2d(h, w2, 1, "SAME", data_format="NCHW")) ** 2)

        def train(x):
            with tf.GradientTape() as tape:
                loss = forward(x)
            for w, g in zip((w1, w2), tape.gradient(loss, [w1, w2])):
                w.assign_sub(1e-3 * g)
            return loss

        knobs = tflms.Knobs(min_bytes=0, swapout_threshold=1, swapin_ahead=1)
        fn = forward if forward_only else train
        step = tf.function(fn) if plain else tflms.function(fn, device=DEVICE, knobs=knobs, **options)
        out = []
        with tf.device(DEVICE), rewrite_options(cpu_layout_conversion=nchw_to_nhwc, **caller):
            ops = ran_op_types(lambda: out.extend(float(step(x)) for _ in range(3)))
        plan = None if plain else step.get_plan(x)
        return {t for t in ops if t.endswith("Transpose")}, out, plan  # oneDNN runs _MklTranspose

    default, losses, plan = ran({})
    tensorflows, tf_losses, _ = ran({"layout_optimizer": True})
    explicit, _, _ = ran({}, layout_optimizer=toggle.ON)
    aggressive, _, _ = ran({}, layout_optimizer=toggle.AGGRESSIVE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LMSWarning)  # nothing to swap in a forward-only step
        unrewritten, _, empty = ran({}, forward_only=True)
    plain_off, plain_off_losses, _ = ran({}, plain=True, layout_optimizer=toggle.OFF)
    plain_on, plain_on_losses, _ = ran({}, plain=True)
    assert plan.swaps and not empty.swaps
    assert not default and not plain_off
    assert tensorflows and explicit and aggressive and unrewritten and plain_on
    # The swaps change no number: each step has the losses of the plain step run the same way
    # (the layouts run other kernels, so the two ways may differ from each other).
    assert losses == plain_off_losses and tf_losses == plain_on_losses
    assert losses[2] < losses[0]
    with pytest.raises(ValueError, match="layout_optimizer must be True or False. Received: .*='no'"):
        tflms.function(lambda x: x, layout_optimizer="no")
    assert "layout_optimizer" not in plan.options and "manual_memory_optimizer" not in plan.options
