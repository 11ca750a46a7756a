"""``offload="optimizer"`` on the one-process CPU pair: bit-identical steps, placement, errors.

``/device:CPU:1`` plays the device and ``/device:CPU:0`` the host (``conftest.py``). The model is
built once, under ``tf.device(DEVICE)`` so its weights live on the device; each run restores its
initial weights and makes a fresh optimizer (``DESIGN.md`` §2: two separately built models may
train differently). The plain run is a ``tf.function`` step with the optimizer built beside the
weights; the offloaded one ``tflms.function(..., offload="optimizer")`` with the optimizer built
by ``tflms.build_optimizer`` on the host. Memory is measured on the test bed
(``tests/testing/test_offload_testbed.py``); one process cannot show it (``DESIGN.md`` §2b).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tflms
from tflms._devices import same_device
from tflms.integrations.keras import short_summary
from tflms.ir.graph import GraphModel
from tflms.plan.passes.offload import offload_decisions
from tflms.testing.zoo import MODELS

import zoo
from conftest import DEVICE, HOST

pytestmark = pytest.mark.integration

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-3),
    "adamw": lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.01),
    "sgd": lambda: keras.optimizers.SGD(0.05),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "rmsprop": lambda: keras.optimizers.RMSprop(1e-3, momentum=0.9, centered=True),
    "adagrad": lambda: keras.optimizers.Adagrad(1e-2),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "adamax": lambda: keras.optimizers.Adamax(1e-3),
    "nadam": lambda: keras.optimizers.Nadam(1e-3),
    "lion": lambda: keras.optimizers.Lion(1e-4),
    "lamb": lambda: keras.optimizers.Lamb(1e-3),
    "adafactor": lambda: keras.optimizers.Adafactor(1e-3),
    "ftrl": lambda: keras.optimizers.Ftrl(1e-2),
}
#: Bit-identical only with Grappler's arithmetic optimizer off (see
#: test_sgd_is_bit_identical_with_the_arithmetic_optimizer_off): the relative tolerance of the comparison.
NOT_BIT_IDENTICAL = {"sgd": 1e-5, "sgd_momentum": 1e-5}
STEPS = 3
#: Nothing is swapped within this budget: the offload alone.
ROOMY = {"budget": "64GiB"}


class Setup:
    """A small CNN (Conv2D, BatchNorm, Dense) on the device, its initial weights and a few batches."""

    def __init__(self) -> None:
        keras.utils.set_random_seed(0)
        with tf.device(DEVICE):
            self.model = MODELS["cnn"][0](32)
        self.initial = [v.numpy() for v in self.model.variables]
        rng = np.random.default_rng(0)
        self.batches = [
            (tf.constant(rng.normal(size=(8, 32, 32, 3)).astype("float32")), tf.constant(rng.integers(0, 10, 8)))
            for _ in range(STEPS)
        ]
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def reset(self) -> None:
        for v, value in zip(self.model.variables, self.initial):
            v.assign(value)

    def step_fn(self, optimizer):
        return zoo.train_step_of(self.model, self.loss_fn, optimizer)

    def run(self, name: str, offload: bool, **options):
        """Losses and final variables of ``STEPS`` steps, and the (rewritten) step."""
        self.reset()
        optimizer = OPTIMIZERS[name]()
        if offload:
            with tf.device(DEVICE):  # the host is where the state goes, whatever the device scope
                tflms.build_optimizer(optimizer, self.model.trainable_variables, HOST)
        way = "optimizer" if offload else None
        run = zoo.offload_run(
            self.model, self.step_fn(optimizer), optimizer, self.batches, way, DEVICE, HOST, **(options or ROOMY)
        )
        return (*run, optimizer)


@pytest.fixture(scope="module")
def setup():
    return Setup()


def _assert_same(a, b, rtol=None):
    if rtol is None:
        assert a[0] == b[0]  # losses, bit for bit
    else:
        np.testing.assert_allclose(a[0], b[0], rtol=rtol)
    for u, v in zip(a[1], b[1]):
        if rtol is None:
            np.testing.assert_array_equal(u, v)
        else:
            np.testing.assert_allclose(u, v, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_offloaded_step_is_bit_identical(setup, name):
    plain = setup.run(name, offload=False)
    off = setup.run(name, offload=True)
    assert plain[0][0] != plain[0][-1]  # it trains
    _assert_same(plain, off, NOT_BIT_IDENTICAL.get(name))
    step, optimizer = off[2], off[3]
    x, y = setup.batches[0]
    _check_placement(step.get_concrete_function(x, y).graph, optimizer, setup.model)


@pytest.mark.parametrize("name", sorted(NOT_BIT_IDENTICAL))
def test_sgd_is_bit_identical_with_the_arithmetic_optimizer_off(setup, name):
    """SGD (with and without momentum): with Grappler's arithmetic optimizer off, the offloaded step's
    losses and weights are the plain step's bit for bit; with it on (the default), they are within
    ``NOT_BIT_IDENTICAL``'s tolerance. Why only a tolerance with it on: in the plain step every op of
    the product chain ``(dy * rsqrt) * lr`` (a BatchNorm's gradient times SGD's learning rate) is on
    one device, and the arithmetic optimizer may reassociate it (the backward's
    ``batchnorm/mul/Mul_1`` then reads the learning rate instead of ``Rsqrt``: read from the
    partitions the runtime ran, ``tflms._tf_internal.ran_graphs``); with ``g * lr`` on the host the
    chain crosses devices and runs as written. Whether the two association orders round apart
    depends on the CPU's kernels (in the last bits on some CPUs, not at all on others), so neither a
    difference nor identity is a promise with it on. With it off both steps run the chain as
    written: the same kernels on the same values, on any CPU. Adam's update reads ``g`` in a ``Sub``
    and a ``Square``, which start no such chain."""
    rtol = NOT_BIT_IDENTICAL[name]
    plain = setup.run(name, offload=False)
    off = setup.run(name, offload=True)
    _assert_same(plain, off, rtol)
    before = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({"arithmetic_optimization": False})
    try:
        plain = setup.run(name, offload=False)
        off = setup.run(name, offload=True)
    finally:
        restored = before.get("arithmetic_optimization", True)
        tf.config.optimizer.set_experimental_options({"arithmetic_optimization": restored})
    _assert_same(plain, off)


def test_offload_composes_with_swaps(setup):
    """With every candidate swapped (``budget=None``) as well, still bit-identical."""
    plain = setup.run("adam", offload=False)
    off = setup.run("adam", offload=True, budget=None, knobs=tflms.Knobs(min_bytes=4096))
    x, y = setup.batches[0]
    assert off[2].get_plan(x, y).swaps
    _assert_same(plain, off)


def _gpt_run(offload: bool, **options):
    """Losses and final weights of ``STEPS`` steps of the zoo's GPT (2 blocks, batch 2, sequence 64,
    Adam) built on the device, plainly or with ``offload="optimizer"`` and ``options``; and the
    offloaded step's plan (``None`` for the plain step)."""
    from tflms.testing.zoo import build

    with tf.device(DEVICE):
        model, x, y, step = build("gpt", 2, 64, layers=2, offload_host=HOST if offload else None)
    if offload:
        run = tflms.function(step, device=DEVICE, host=HOST, offload="optimizer", **options)
        plan = run.get_plan(x, y)
    else:
        run, plan = tf.function(step), None
    with tf.device(DEVICE):
        losses = [run(x, y).numpy() for _ in range(STEPS)]
    return losses, [v.numpy() for v in model.variables], plan


def test_gpt_offload_composes_with_swaps_and_a_swapout_window():
    """The configuration of the capacity measurement (``benchmarks/offload_capacity.py``): the
    optimizer offloaded, every activation of 4 kB or more swapped, at most 2 swap-outs in flight;
    bit-identical to the plain step, losses and every weight."""
    plain = _gpt_run(False)
    off = _gpt_run(True, budget=None, knobs=tflms.Knobs(min_bytes=4096, serialize=False, swapout_window=2))
    plan = off[2]
    assert plan.options["offload"] == "optimizer" and plan.options["swapout_window"] == 2
    assert len(plan.swaps) > 20 and plan.fences
    assert len(plain[1]) == len(off[1]) > 20
    _assert_same(plain, off)


def _check_placement(graph, optimizer, model):
    """Slots on the host, update ops on the host, weights and their assigns on the device."""
    slots = [v for v in optimizer.variables if len(v.shape)]
    assert bool(slots) == (type(optimizer).__name__ != "SGD" or optimizer.momentum != 0)  # plain SGD has none
    assert all(same_device(v.value.device, HOST) for v in slots)
    assert all(same_device(v.value.device, DEVICE) for v in model.trainable_variables)
    handles = {id(ext): internal.op.name for ext, internal in graph.captures}
    slot_handles = {handles[id(v.value.handle)] for v in slots if id(v.value.handle) in handles}
    weight_handles = {handles[id(v.value.handle)] for v in model.trainable_variables}
    assert len(slot_handles) == len(slots)
    placed = [op for op in graph.get_operations() if _attr(op) == b"offload"]
    assert placed and all(same_device(op.device, HOST) for op in placed)
    assert any(op.type == "IdentityN" for op in placed)  # the gradients' first reader: they leave at once
    writes = ("AssignVariableOp", "AssignSubVariableOp", "AssignAddVariableOp")
    ops = [op for op in graph.get_operations() if op.type in writes]
    weight_writes = [op for op in ops if op.inputs[0].op.name in weight_handles]
    slot_writes = [op for op in ops if op.inputs[0].op.name in slot_handles]
    assert len(weight_writes) >= len(model.trainable_variables) and bool(slot_writes) == bool(slots)
    # Left unplaced: the placer colocates each with its variable (the weight's on the device).
    assert all(op.device == "" for op in weight_writes + slot_writes)
    # Each weight's change from its gradient is computed on the host: one write per weight reads a
    # host op (AdamW's decay, ``w -= w * wd * lr``, reads only device values and stays there).
    from_host = [
        op
        for op in weight_writes
        if same_device(op.inputs[1].op.device, HOST)  # Adam's step, SGD's g * lr
        or (op.inputs[1].op.type == "ReadVariableOp" and op.inputs[1].op.inputs[0].op.name in slot_handles)  # momentum
    ]
    assert {op.inputs[0].op.name for op in from_host} == weight_handles
    for op in weight_writes:
        if op not in from_host:
            assert op.inputs[1].op.type == "Mul" and op.inputs[1].op.device == "", op.name


def _attr(op):
    try:
        return op.get_attr("_tflms_swap")
    except ValueError:
        return None


def test_decisions_on_traced_adam_step(setup):
    """What the graph-model pass decides: the slots are the state; no forward or backward op moves."""
    optimizer = OPTIMIZERS["adam"]()
    tflms.build_optimizer(optimizer, setup.model.trainable_variables, HOST)
    x, y = setup.batches[0]
    graph = tf.function(setup.step_fn(optimizer)).get_concrete_function(x, y).graph
    model = GraphModel.from_func_graph(graph)
    d = offload_decisions(model)
    slots = [v for v in optimizer.variables if len(v.shape)]
    assert len([t for t in d.variables if model.tensors[t]]) >= len(slots)
    # The update, and the forward ops that only feed it (the learning rate's casts); no gradient op.
    assert all(model.phase(op) in ("update", "forward") for op in d.ops)
    assert any(model.phase(op) == "update" for op in d.ops)
    assert not any(op.startswith("gradient_tape/") or model.phase(op) == "backward" for op in d.ops)


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd_momentum"])
def test_fit_with_callback_is_bit_identical(setup, name):
    """``model.fit`` with ``LMSCallback(offload="optimizer")``: the callback builds the optimizer on the
    host; the same losses and weights as a plain ``fit`` (SGD: see ``NOT_BIT_IDENTICAL``)."""
    results = []
    for offload in (None, "optimizer"):
        setup.reset()
        model = setup.model
        model.compile(optimizer=OPTIMIZERS[name](), loss=setup.loss_fn, jit_compile=False)
        x = np.concatenate([b[0].numpy() for b in setup.batches])
        y = np.concatenate([b[1].numpy() for b in setup.batches])
        callbacks = [tflms.LMSCallback(device=DEVICE, host=HOST, offload=offload, **ROOMY)] if offload else []
        with tf.device(DEVICE):
            history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
        slots = [v for v in model.optimizer.variables if len(v.shape)]
        on_host = [same_device(v.value.device, HOST) for v in slots]
        results.append((history.history["loss"], [v.numpy() for v in model.variables], on_host))
    (plain_loss, plain_vars, plain_host), (off_loss, off_vars, off_host) = results
    assert not any(plain_host) and all(off_host) and off_host
    assert plain_loss[-1] < plain_loss[0]
    assert "the optimizer's state and update on the host" in short_summary(callbacks[0].plan)
    _assert_same((plain_loss, plain_vars), (off_loss, off_vars), NOT_BIT_IDENTICAL.get(name))


# -- errors ---------------------------------------------------------------------------------------


def test_offload_values():
    assert tflms.LMSConfig(offload="optimizer").offload == "optimizer"
    assert tflms.LMSConfig().offload is None
    cfg = tflms.LMSConfig(offload="optimizer", budget="1GiB")
    assert cfg.to_dict()["offload"] == "optimizer" and tflms.LMSConfig.from_dict(cfg.to_dict()) == cfg
    assert "offload" not in tflms.LMSConfig().to_dict()  # the options of plans made without it are unchanged
    assert tflms.LMSConfig().replace(offload="optimizer").offload == "optimizer"
    assert tflms.LMSConfig(offload="weights").offload == "weights"  # tests/integrations/test_offload_weights.py
    with pytest.raises(ValueError, match=r"None, 'optimizer' or 'weights'.*Received: offload='everything'"):
        tflms.function(lambda: 0, offload="everything")
    with pytest.raises(ValueError, match=r"Received: offload=True"):
        tflms.LMSCallback(offload=True)


def test_offload_refuses_xla():
    step = tf.function(lambda x: x * 2, jit_compile=True)
    with pytest.raises(ValueError, match=r"XLA.*Received: offload='optimizer'"):
        tflms.function(step, offload="optimizer")


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()),
        lambda: keras.optimizers.Adam(gradient_accumulation_steps=2),
        lambda: tf.compat.v1.train.AdamOptimizer(),
    ],
)
def test_offload_refuses_unchecked_optimizer(setup, make):
    with pytest.raises(ValueError, match=r"(checked are Adam, AdamW, SGD|gradient accumulation).*Received: offload="):
        tflms.build_optimizer(make(), setup.model.trainable_variables, HOST)


def test_offload_refuses_state_on_device(setup):
    """An optimizer built beside the weights: tflms.function says how to build it instead."""
    setup.reset()
    optimizer = OPTIMIZERS["adam"]()
    with tf.device(DEVICE):
        optimizer.build(setup.model.trainable_variables)
    step = tflms.function(setup.step_fn(optimizer), device=DEVICE, host=HOST, offload="optimizer", **ROOMY)
    x, y = setup.batches[0]
    with pytest.raises(ValueError, match=r"tflms.build_optimizer.*Received: offload='optimizer'"):
        step.get_concrete_function(x, y)
    with pytest.raises(ValueError, match=r"slot variables elsewhere.*Received: offload='optimizer'"):
        tflms.build_optimizer(optimizer, setup.model.trainable_variables, HOST)


def test_optimize_plans_the_offloaded_step_and_replay_makes_it_again(setup):
    """``tflms.optimize(cf, offload="optimizer")``: the given function is left plain, the plan's
    predicted peak is the offloaded step's (below the plain step's), and ``replay`` of the plan on
    the plain step's graph model gives that step again (the offload is in the plan's options)."""
    from tflms.emulate.simulator import Simulator
    from tflms.plan.registry import replay

    setup.reset()
    optimizer = OPTIMIZERS["adam"]()
    tflms.build_optimizer(optimizer, setup.model.trainable_variables, HOST)
    x, y = setup.batches[0]
    cf = tf.function(setup.step_fn(optimizer)).get_concrete_function(x, y)
    new_cf, plan = tflms.optimize(cf, device=DEVICE, host=HOST, offload="optimizer", **ROOMY)
    assert new_cf is not cf and not plan.swaps and plan.options["offload"] == "optimizer"
    assert not any(_attr(op) == b"offload" for op in cf.graph.get_operations())
    assert any(_attr(op) == b"offload" for op in new_cf.graph.get_operations())
    model = GraphModel.from_func_graph(cf.graph)
    assert Simulator(replay(model, plan), HOST).peak() == plan.peak_bytes_after
    assert plan.peak_bytes_after < Simulator(model, HOST).peak()
    assert tflms.optimize(new_cf, device=DEVICE, host=HOST, offload="optimizer")[0] is new_cf  # not twice


def test_the_runtime_runs_the_update_on_the_host_and_the_weights_assigns_on_the_device(setup):
    """The partitions TensorFlow ran (after Grappler and its placer): Adam's arithmetic and the
    reads and writes of its slots in the host's, each weight's assign in the device's, and every
    gradient sent from the device to the host."""
    from tflms import _tf_internal as tfi

    setup.reset()
    optimizer = OPTIMIZERS["adam"]()
    tflms.build_optimizer(optimizer, setup.model.trainable_variables, HOST)
    step = tflms.function(setup.step_fn(optimizer), device=DEVICE, host=HOST, offload="optimizer", **ROOMY)
    x, y = setup.batches[0]
    with tf.device(DEVICE):
        partitions = tfi.ran_graphs(lambda: step(x, y))
    nodes = [n for g in partitions for n in g.node]
    on = {n.name: n.device for n in nodes}
    host_side = [n for n in nodes if same_device(n.device, HOST)]
    device_side = [n for n in nodes if same_device(n.device, DEVICE)]
    assert host_side and device_side
    # Adam's square roots (one per weight) run on the host only.
    assert sum(n.op == "Sqrt" for n in host_side) >= len(setup.model.trainable_variables)
    assert not any(n.op == "Sqrt" and n.name.startswith("adam") for n in device_side)
    # The weights are assigned on the device (AssignSubVariableOp), the slots on the host (AssignAdd).
    n_weights = len(setup.model.trainable_variables)
    assert sum(n.op == "AssignSubVariableOp" for n in device_side) == n_weights
    assert sum(n.op == "AssignAddVariableOp" and n.name.startswith("adam") for n in host_side) == 2 * n_weights
    # The gradients go to the host: the device sends them (one _Send per tensor and destination).
    sends = [n for n in device_side if n.op == "_Send"]
    assert len(sends) >= n_weights, sorted(on)[:5]
