"""A placement job with copy-only ops on the host, in a process of its own: three logical CPUs,
``/device:CPU:0`` the host and ``/device:CPU:1``, ``/device:CPU:2`` the two devices (as
``tests/placement_job.py``, whose set-up it imports).

Run as ``python tests/placement_host_job.py MODEL [MODEL ...]`` (models of ``tests/zoo.py``); prints
one JSON object per model on its own line, prefixed ``RESULT ``. Each model's step is placed on the
two devices with the ``ConcatV2`` ops of its ``Concatenate`` layers and the ``Slice`` ops of their
gradients on the host (``host_ops``, :func:`tflms.integrations.placement.placed_function`). A model
named ``swap:NAME`` is placed so too under a budget of 0.6 times the placement's largest predicted
device peak (``on_budget_miss="best"``), so that swaps are planned and applied per device:

* ``plain_losses``/``placed_losses`` and ``weights_differ``: 3 Adam steps of the plain step and of
  the placed one from the same initial state, and the variables (weights and optimizer state) that
  are not bit-identical after them;
* ``host_ops``: the ops the plan puts on the host; ``host_ran``: those of them found in the graphs
  TensorFlow ran (the partition graphs of the placed step's first call), each with the devices it
  ran on; ``misplaced``: placed ops that ran on another device than the plan says;
* ``ran``: per device (host included), how many of the ops the plan puts there ran there;
* the plan's stages (device, number of ops, predicted peak); ``swapped``: per device, the tensors
  whose swap-ins land there; ``swap_ops``: per kind (``out``, ``in``, ``landing``), how many ran
  and how many ran on another device than the rewrite set (``swap_misplaced``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import placement_job
import tensorflow as tf

import tflms
from tflms._devices import same_device
from tflms.integrations.placement import device_plans, placed_function
from tflms.plan.passes.place import copy_ops, placement_plan
from tflms.rewrite.apply import SWAP_ATTR

import zoo

DEVICES = placement_job.DEVICES
HOST = "/device:CPU:0"
STEPS = placement_job.STEPS


def _placed_by_rewrite(op: tf.Operation) -> bool:
    return op.type != "Placeholder" and not any(t.dtype == tf.resource for t in op.inputs)


def _swap_kind(op: tf.Operation) -> str | None:
    try:
        return op.get_attr(SWAP_ATTR).decode()
    except ValueError:
        return None


def run(name: str) -> dict:
    swap = name.startswith("swap:")
    name = name.removeprefix("swap:")
    with tf.device(DEVICES[0]):
        setup = zoo.ZOO[name]()
    plain = tf.function(setup.step_fn())
    plain_losses, plain_state = zoo.run_steps(setup, plain, n=STEPS, device=DEVICES[0])
    cf = tf.function(setup.step_fn()).get_concrete_function(setup.x, setup.y)
    model = tflms.GraphModel.from_func_graph(cf.graph)
    host_ops = [op for op in copy_ops(model, min_bytes=0) if "concatenate" in op.split("/")[-2]]
    config = tflms.LMSConfig(devices=DEVICES, host=HOST)
    if swap:
        largest = placement_plan(model, config, host_ops).peak_bytes_after
        config = config.replace(budget=int(0.6 * largest), on_budget_miss="best")
    placed, plan = placed_function(cf, model, config, copy=True, host_ops=host_ops)
    where = {op: st.device for st in plan.placement for op in st.ops}
    names = {op.name for op in placed.graph.get_operations() if _placed_by_rewrite(op)}
    seen = placement_job.devices_ran(placed, setup)
    misplaced = [
        (op, where[op], devices)
        for op, devices in seen.items()
        if op in names and op in where and not all(same_device(d, where[op]) for d in devices)
    ]
    swap_ops: dict[str, list[int]] = {}
    swap_misplaced = []
    for op in placed.graph.get_operations():
        kind = _swap_kind(op)
        if kind in ("out", "in", "landing"):
            counts = swap_ops.setdefault(kind, [0, 0])
            counts[0] += 1
            if op.name in seen:
                counts[1] += 1
                if not all(same_device(d, op.device) for d in seen[op.name]):
                    swap_misplaced.append((op.name, op.device, seen[op.name]))
    placed_losses, placed_state = zoo.run_steps(setup, placed, n=STEPS, device=DEVICES[0])
    pairs = zip(setup.state(), plain_state, placed_state)
    differ = [getattr(v, "path", v.name) for v, a, b in pairs if not np.array_equal(a, b)]
    on_host = sorted(op for op, d in where.items() if same_device(d, HOST))
    return {
        "model": ("swap:" if swap else "") + name,
        "budget": config.budget,
        "peak_bytes_after": plan.peak_bytes_after,
        "swapped": {d: [s.tensor for s in sub.swaps] for d, sub in device_plans(plan)},
        "swapped_from_elsewhere": [
            s.tensor for d, sub in device_plans(plan) for s in sub.swaps if not same_device(where[s.producer], d)
        ],
        "n_orders": len(plan.orders),
        "swap_ops": swap_ops,
        "swap_misplaced": swap_misplaced[:5],
        "plain_losses": plain_losses.tolist(),
        "placed_losses": placed_losses.tolist(),
        "weights_differ": differ,
        "n_state": len(plain_state),
        "asked": host_ops,
        "host_ops": on_host,
        "host_types": sorted({model.dag.nodes[op]["type"] for op in on_host}),
        "host_ran": {op: seen[op] for op in on_host if op in seen},
        "misplaced": misplaced[:5],
        "n_misplaced": len(misplaced),
        "ran": {
            d: sum(1 for op in names if op in seen and op in where and same_device(where[op], d))
            for d in (*DEVICES, HOST)
        },
        "stages": [(st.device, len(st.ops), st.peak_bytes) for st in plan.placement],
        "reason": plan.reason,
    }


if __name__ == "__main__":
    for model in sys.argv[1:]:
        print("RESULT " + json.dumps(run(model)), flush=True)
