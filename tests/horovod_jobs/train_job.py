"""Worker of tests/test_horovod.py, started by ``horovodrun --gloo -np 2``.

Each rank: splits the CPU (/device:CPU:1 = compute device), initialises
Horovod, builds the CNN of jobkit with a rank-dependent seed, broadcasts
rank 0's variables, then trains ``--steps`` steps through ``@tflms.function``
from the same state once per tape: ``tflms.integrations.horovod.DistributedGradientTape`` on
Keras variables (default groups, and 1 KiB groups) and ``hvd.DistributedGradientTape``
on ``[v.value for v in ...]``, and (``offload``) the first with ``offload="optimizer"``: the
optimizer's state on the host, so the gradients are averaged there, and (``placed``) the first with
``devices=jobkit.PLACED``: each rank places its step on its own two devices. It writes
``<out>/<kind>_rank<r>.npz`` (final
model + optimizer state), ``<out>/initial.npz`` (rank 0, after the broadcast)
and ``<out>/rank<r>.json`` (plans, structure of the rewritten graphs, helper
results). ``--crash-rank R --crash-step S`` makes rank R raise at step S.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import jobkit

CRASH_MESSAGE = "tflms-test: rank {rank} fails on purpose at step {step}"


def rewritten_structure(lms_fn, x, y) -> dict:
    """What the rewritten graph holds (:func:`jobkit.graph_structure`), and its control flow ops."""
    graph = lms_fn.get_concrete_function(x, y).graph
    control_flow = sorted(op.type for op in graph.get_operations() if op.type in ("If", "StatelessIf"))
    return jobkit.graph_structure(graph) | {"control_flow_ops": control_flow}


def collective_report(rank: int) -> dict:
    """A step with a collective in the forward pass (like synchronised batch statistics).

    Its forward ``HorovodAllreduce`` output is a large activation read again by the
    backward pass, and the backward pass holds the allreduce's gradient (another
    ``HorovodAllreduce``) right before a consumer of a swapped tensor: without the
    collective exclusion, the planner would swap the one and trigger on the other.
    """
    import horovod.tensorflow as hvd
    import keras
    import numpy as np
    import tensorflow as tf

    import tflms
    import tflms.integrations.horovod as lms_hvd
    from tflms.ir.graph import GraphModel
    from tflms.plan import candidates, planner

    keras.utils.set_random_seed(7)
    first = keras.layers.Dense(256, activation="relu")
    rest = [keras.layers.Dense(256, activation="relu") for _ in range(4)] + [keras.layers.Dense(10)]
    layers = [first, *rest]
    opt = keras.optimizers.SGD(0.01)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(rank)
    x = tf.constant(rng.normal(size=(16, 64)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=(16,)).astype("int32"))
    h = x
    for layer in layers:
        h = layer(h)
    variables = [v for layer in layers for v in layer.trainable_variables]
    opt.build(variables)
    lms_hvd.broadcast_variables(variables + list(opt.variables))

    def train_step(x, y):
        with tf.GradientTape() as tape:
            h = hvd.allreduce(first(x), op=hvd.Average)
            for layer in rest:
                h = layer(h)
            value = loss(y, h)
        grads = lms_hvd.DistributedGradientTape(tape).gradient(value, variables)
        opt.apply_gradients(zip(grads, variables))
        return value

    options = {**jobkit.LMS_OPTIONS, "knobs": jobkit.KNOBS.replace(swapin_ahead=1)}
    step = tflms.function(train_step, **options)
    plan = step.get_plan(x, y)
    losses = [float(step(x, y)) for _ in range(2)]
    model = GraphModel.from_func_graph(tf.function(train_step).get_concrete_function(x, y).graph)
    hvd_nodes = {n: d for n, d in model.dag.nodes(data=True) if d["type"].startswith("Horovod")}
    original = candidates.is_collective  # where the planner's candidate rules live
    candidates.is_collective = lambda op_type: False
    try:
        unguarded = planner.make_plan(model, tflms.LMSConfig(**options))
    finally:
        candidates.is_collective = original
    return {
        "structure": rewritten_structure(step, x, y),
        "n_swaps": len(plan.swaps),
        "plan_producer_types": sorted(s.producer_type for s in plan.swaps),
        "plan_trigger_types": sorted(
            model.dag.nodes[si.trigger]["type"] for s in plan.swaps for si in s.swap_ins if si.trigger
        ),
        "horovod_phases": sorted(d["phase"] for d in hvd_nodes.values()),
        "unguarded_producer_types": sorted(s.producer_type for s in unguarded.swaps),
        "unguarded_trigger_types": sorted(
            model.dag.nodes[si.trigger]["type"] for s in unguarded.swaps for si in s.swap_ins if si.trigger
        ),
        "losses": losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--crash-rank", type=int, default=-1)
    parser.add_argument("--crash-step", type=int, default=1)
    parser.add_argument("--crash-mode", choices=("raise", "exit"), default="raise", help="raise, or os._exit(3)")
    parser.add_argument("--kinds", default="tflms,grouped,workaround,offload,placed")
    parser.add_argument("--no-extras", action="store_true", help="skip the helper and collective checks")
    args = parser.parse_args()

    jobkit.split_cpu()
    import numpy as np
    import tensorflow as tf

    import tflms
    import tflms.integrations.horovod as lms_hvd

    lms_hvd.init()
    rank, size = lms_hvd.rank(), lms_hvd.size()
    batches = jobkit.global_batches(args.steps, size)
    model = jobkit.build_cnn(seed=0 if rank == 0 else 100 + rank)
    opt = jobkit.make_optimizer()
    opt.build(model.trainable_variables)
    variables = jobkit.state(model, opt)
    report: dict = {
        "rank": rank,
        "size": size,
        "local_rank": lms_hvd.local_rank(),
        "local_size": lms_hvd.local_size(),
        "is_root": lms_hvd.is_root(),
        "pid": os.getpid(),
        "digest_before_broadcast": jobkit.digest([v.numpy() for v in variables]),
    }
    lms_hvd.broadcast_variables(variables, root_rank=0)
    initial = [v.numpy() for v in variables]
    report["digest_after_broadcast"] = jobkit.digest(initial)
    if rank == 0:
        np.savez(os.path.join(args.out, "initial.npz"), *initial)

    for kind in args.kinds.split(","):
        for v, value in zip(variables, initial):
            v.assign(value)
        if kind == "offload":  # the optimizer's state and update on the host, the gradients averaged there
            from tflms.integrations.offload import build_optimizer

            host_opt = build_optimizer(jobkit.make_optimizer(), model.trainable_variables, jobkit.HOST)
            kind_state = jobkit.state(model, host_opt)
            for v, value in zip(kind_state, initial):
                v.assign(value)
            step = jobkit.lms_step(model, host_opt, "tflms", offload="optimizer")
        elif kind == "placed":  # each rank places its step on its own two devices
            kind_state = variables
            step = jobkit.lms_step(model, opt, "tflms", devices=list(jobkit.PLACED))
        else:
            kind_state = variables
            step = jobkit.lms_step(model, opt, kind)
        x0, y0 = jobkit.shard(batches[0], rank)
        plan = step.get_plan(x0, y0)
        fingerprint = lms_hvd.assert_same_plan(plan)
        losses = []
        for i, batch in enumerate(batches):
            if rank == args.crash_rank and i == args.crash_step:
                message = CRASH_MESSAGE.format(rank=rank, step=i)
                if args.crash_mode == "exit":  # dies without Horovod's shutdown: peers see a lost connection
                    print(message, file=sys.stderr, flush=True)
                    os._exit(3)
                raise RuntimeError(message)
            losses.append(float(step(*jobkit.shard(batch, rank))))
        np.savez(os.path.join(args.out, f"{kind}_rank{rank}.npz"), *[v.numpy() for v in kind_state])
        report[kind] = {
            "fingerprint": fingerprint,
            "plan_json_sha256": hashlib.sha256(plan.to_json().encode()).hexdigest(),
            "n_swaps": len(plan.swaps),
            "n_swap_ins": plan.n_swap_ins,
            "losses": losses,
            "structure": rewritten_structure(step, x0, y0),
        }

    if not args.no_extras:
        # A plan that differs on purpose (rank-dependent option): every rank must raise.
        other = jobkit.lms_step(model, opt, "tflms", knobs=jobkit.KNOBS.replace(swapout_threshold=3 + rank))
        try:
            lms_hvd.assert_same_plan(other.get_plan(x0, y0))
            report["mismatch_error"] = None
        except lms_hvd.PlanMismatchError as err:
            report["mismatch_error"] = str(err)
        report["average_logs"] = lms_hvd.average_logs(
            {"loss": float(rank + 1), "acc": np.float32(0.25 * rank), "t": tf.constant(2.0 * rank), "tag": "x"}
        )
        report["collective"] = collective_report(rank)
    report["tflms_version"] = tflms.__version__
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
    print(f"rank {rank}: done", file=sys.stderr)


if __name__ == "__main__":
    main()
