"""A placement job in a process of its own: three logical CPUs, ``/device:CPU:0`` the host and
``/device:CPU:1``, ``/device:CPU:2`` the two devices (the suite's ``conftest.py`` makes two).

Run as ``python tests/placement_job.py MODEL [MODEL ...]`` (models of ``tests/zoo.py``); prints one
JSON object per model on its own line, prefixed ``RESULT ``:

* ``plain_losses``/``placed_losses``: 3 Adam steps of the plain ``tf.function`` step and of
  ``tflms.function(step, devices=DEVICES)`` from the same initial state (the model built under
  ``tf.device(DEVICES[0])``), and ``weights_differ``: the variables (weights and optimizer state)
  that are not bit-identical after them;
* ``ran``: per device, the placed ops found in the graphs TensorFlow ran (the partition graphs of
  the placed step's first call); ``misplaced``: the placed ops that ran on another device than the
  plan says; ``graph_misplaced``: the ops of the rewritten graph whose device is not the plan's;
* ``again_same``: ``tflms.optimize`` of the rewritten function returns it unchanged, and
  ``replaced``: how many devices a second :func:`tflms.rewrite.apply.apply_placement` changed;
* the plan's predicted peaks.

A model named ``fit:NAME`` runs :func:`fit` instead: ``model.fit`` with and without
``tflms.LMSCallback(devices=DEVICES)``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)
tf.config.experimental.enable_op_determinism()

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import tflms  # noqa: E402
from tflms import _tf_internal as tfi  # noqa: E402
from tflms._devices import same_device  # noqa: E402
from tflms.rewrite.apply import apply_placement  # noqa: E402

import zoo  # noqa: E402

DEVICES = ["/device:CPU:1", "/device:CPU:2"]
STEPS = 3


def _placed_by_rewrite(op: tf.Operation) -> bool:
    return op.type != "Placeholder" and not any(t.dtype == tf.resource for t in op.inputs)


def devices_ran(placed: Any, setup: Any) -> dict[str, list[str]]:
    """Per op name, the devices of the partitions TensorFlow ran it in, for one call of ``placed``
    on ``setup``'s batch (its state reset first)."""
    setup.reset()
    with tf.device(DEVICES[0]):
        ran = tfi.ran_graphs(lambda: placed(setup.x, setup.y))
    seen: dict[str, list[str]] = {}
    for g in ran:
        for node in g.node:
            seen.setdefault(node.name, []).append(node.device)
    return seen


def run(name: str) -> dict:
    with tf.device(DEVICES[0]):
        setup = zoo.ZOO[name]()
    plain = tf.function(setup.step_fn())
    plain_losses, plain_state = zoo.run_steps(setup, plain, n=STEPS, device=DEVICES[0])
    placed = tflms.function(setup.step_fn(), devices=DEVICES)
    plan = placed.get_plan(setup.x, setup.y)
    cf = placed.get_concrete_function(setup.x, setup.y)
    where = {op: st.device for st in plan.placement for op in st.ops}
    graph_misplaced = [
        op.name
        for op in cf.graph.get_operations()
        if _placed_by_rewrite(op) and not same_device(op.device, where[op.name])
    ]
    seen = devices_ran(placed, setup)
    placed_ops = {op.name for op in cf.graph.get_operations() if _placed_by_rewrite(op)}
    misplaced = [
        (op, where[op], devices)
        for op, devices in seen.items()
        if op in placed_ops and not all(same_device(d, where[op]) for d in devices)
    ]
    ran_on = {d: sum(1 for op in placed_ops if op in seen and where[op] == d) for d in DEVICES}
    placed_losses, placed_state = zoo.run_steps(setup, placed, n=STEPS, device=DEVICES[0])
    pairs = zip(setup.state(), plain_state, placed_state)
    differ = [getattr(v, "path", v.name) for v, a, b in pairs if not np.array_equal(a, b)]
    again, again_plan = tflms.optimize(cf, devices=DEVICES)
    before = {op.name: op.device for op in cf.graph.get_operations()}
    apply_placement(cf.graph, plan.placement)
    replaced = sum(before[op.name] != op.device for op in cf.graph.get_operations())
    return {
        "model": name,
        "plain_losses": plain_losses.tolist(),
        "placed_losses": placed_losses.tolist(),
        "weights_differ": differ,
        "n_state": len(plain_state),
        "ran": ran_on,
        "n_placed": {d: sum(1 for op in placed_ops if where[op] == d) for d in DEVICES},
        "misplaced": misplaced[:5],
        "n_misplaced": len(misplaced),
        "graph_misplaced": graph_misplaced[:5],
        "again_same": again is cf and again_plan == plan,
        "replaced": replaced,
        "peaks": [st.peak_bytes for st in plan.placement],
        "plain_peak": plan.peak_bytes_before,
        "devices": [st.device for st in plan.placement],
        "summary": plan.summary(),
    }


def fit(name: str) -> dict:
    """``model.fit`` (2 epochs of 2 batches) plain and with ``LMSCallback(devices=DEVICES)`` from the
    same initial state: the histories, the variables that differ, and the callback's placement."""
    with tf.device(DEVICES[0]):
        setup = zoo.ZOO[name]()
    setup.model.compile(optimizer=setup.optimizer, loss=setup.loss, jit_compile=False)
    n = setup.x.shape[0]
    x = np.concatenate([setup.x.numpy()] * 2)
    y = np.concatenate([setup.y.numpy()] * 2)

    def run_fit(callbacks: list) -> tuple[dict, list]:
        setup.reset()
        with tf.device(DEVICES[0]):
            history = setup.model.fit(x, y, batch_size=n, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
        return history.history, [v.numpy() for v in setup.state()]

    plain_history, plain_state = run_fit([])
    cb = tflms.LMSCallback(devices=DEVICES)
    placed_history, placed_state = run_fit([cb])
    pairs = zip(setup.state(), plain_state, placed_state)
    return {
        "model": f"fit:{name}",
        "plain_history": plain_history,
        "placed_history": placed_history,
        "weights_differ": [getattr(v, "path", v.name) for v, a, b in pairs if not np.array_equal(a, b)],
        "n_stages": len(cb.plan.placement) if cb.plan is not None else 0,
        "devices": [st.device for st in cb.plan.placement] if cb.plan is not None else [],
    }


if __name__ == "__main__":
    for model in sys.argv[1:]:
        result = fit(model[len("fit:") :]) if model.startswith("fit:") else run(model)
        print("RESULT " + json.dumps(result), flush=True)
