"""Functions run inside a measured test-bed process by tests/test_testbed.py."""

from __future__ import annotations

from typing import Any

# The jobs the benchmarks run too live in tflms.testing.jobs; the tests name them here as well
# ("testbed_jobs:offload_gpt", ...).
from tflms.testing.jobs import keras_hub_gpt2_fit, offload_gpt, resnet_steps, twoinput_fit

__all__ = ["keras_hub_gpt2_fit", "offload_gpt", "resnet_steps", "twoinput_fit"]


def decorated_step_reports_memory(model: str = "cnn", batch: int = 32, steps: int = 3) -> dict[str, Any]:
    """A model of tflms.testing.zoo.MODELS through ``@tflms.function`` with the test bed's device and host:
    losses of the plain and rewritten steps from the same state (one warm-up step, then
    ``steps``), each one's steady-state measured peak, and the rewritten step's
    ``LMSFunction.memory_report`` over the same steps next to the prediction."""
    import tensorflow as tf

    import tflms
    from tflms import testbed
    from tflms.testing.zoo import build

    tf.config.experimental.enable_op_determinism()
    keras_model, x, y, step = build(model, batch)
    state = list(keras_model.variables) + list(step.optimizer.variables)
    initial = [v.numpy() for v in state]
    out: dict[str, Any] = {}
    plain = tf.function(step)
    lms = tflms.function(step, device=testbed.DEVICE, host=testbed.HOST)
    for name, fn in (("plain", plain), ("lms", lms)):
        for v, value in zip(state, initial):
            v.assign(value)
        with tf.device(testbed.DEVICE):
            losses = [float(fn(x, y))]  # warm-up: the first call instantiates the function
            if name == "lms":
                lms.reset_peak(x, y)
            else:
                testbed.reset_peak()
            for _ in range(steps):
                losses.append(float(fn(x, y)))
        out[name] = {"losses": losses, "peak": testbed.memory()["peak"]}
    out["report"] = lms.memory_report(x, y)
    return out


def planned_peak(model: str = "transformer", batch: int = 8, **options: Any) -> int:
    """The predicted peak of the test bed's plan for a model of tflms.testing.zoo.MODELS under ``options``,
    made in a fresh process as :func:`tflms.testing.measure.anatomy_step` makes it (graph names and so
    ties in the simulator's order depend on what the process traced before)."""
    import tensorflow as tf

    import tflms
    from tflms import testbed
    from tflms.testing.zoo import build

    _, x, y, step = build(model, batch)
    cf = tf.function(step).get_concrete_function(x, y)
    plan = tflms.make_plan(tflms.GraphModel.from_func_graph(cf.graph), tflms.LMSConfig(host=testbed.HOST, **options))
    assert plan.recomputes or "recompute" not in options.get("policy", ()), "no recomputes planned"
    return plan.peak_bytes_after


def priorities() -> dict[str, Any]:
    """Nice values inside a measured process: of its threads (TensorFlow's among them), of a
    thread started now, and of its host worker (the child running ``tflms.testing.testbed --port``)."""
    import os
    import threading

    import tensorflow as tf

    tf.constant(1.0) + 1.0  # TensorFlow's threads run
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, 0)))
    t.start()
    t.join()
    threads = []
    for tid in os.listdir("/proc/self/task"):
        try:
            threads.append(os.getpriority(os.PRIO_PROCESS, int(tid)))
        except OSError:  # a thread that has ended since
            continue
    workers = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == os.getpid() and b"tflms.testing.testbed" in cmdline and b"--port" in cmdline:
            workers.append(os.getpriority(os.PRIO_PROCESS, int(pid)))
    return {"threads": threads, "new_thread": seen[0], "workers": workers}


def update_copies(model: str = "cnn", batch: int = 32, warmup: int = 2, profiled: int = 3) -> dict[str, Any]:
    """The variable copies of each of ``profiled`` profiled steps of ``model``'s rewritten step, with
    ``order_updates`` on and off, and the losses of every step.

    An in-place update (``AssignSubVariableOp``) allocates only when TensorFlow copies the variable
    first, because a tensor read from it is still held (``PrepareToUpdateVariable``); the test bed's
    BFC allocator records the op behind every allocation while the profiler runs.
    """
    import tensorflow as tf

    import tflms
    from tflms import _tf_internal as tfi
    from tflms import testbed
    from tflms.testing.zoo import build

    tf.config.experimental.enable_op_determinism()
    keras_model, x, y, step = build(model, batch)
    state = list(keras_model.variables) + list(step.optimizer.variables)
    initial = [v.numpy() for v in state]
    cf = tf.function(step).get_concrete_function(x, y)
    out: dict[str, Any] = {}
    for name, order_updates in (("ordered", True), ("copying", False)):
        for v, value in zip(state, initial):
            v.assign(value)
        policy = ("default", "order_updates") if order_updates else "default"
        lms, plan = tflms.optimize(cf, device=testbed.DEVICE, host=testbed.HOST, policy=policy)
        losses: list[float] = []
        with tf.device(testbed.DEVICE), tflms.manual_memory_optimizer():
            for _ in range(warmup):
                losses.append(float(lms(x, y)))
            copies = []
            for _ in range(profiled):
                records, _ = tfi.profile_step(lambda lms=lms, losses=losses: losses.append(float(lms(x, y))))
                copies.append(
                    [
                        (r["op"], r["requested"])
                        for r in records
                        if r["kind"] == "alloc" and "AssignSubVariableOp" in (r["op"] or "")
                    ]
                )
        out[name] = {"losses": losses, "copies": copies, "n_orders": len(plan.orders)}
    return out


def tile_allocations(model: str = "cnn", batch: int = 32, warmup: int = 1) -> dict[str, Any]:
    """What the per-channel copies of the mean gradients allocate in one profiled step of ``model``'s
    rewritten step, with ``drop_tiles`` on and off (``split_sums`` on in both), and the losses of
    every step: the test bed's BFC allocator records the op behind every allocation while the
    profiler runs. ``tile_bytes``: each ``Tile`` op's output bytes; per case: ``(op, requested
    bytes)`` of each allocation by a ``Tile`` op and by an op made again for a left-out one
    (``.../tflms_bcast``), and the peak of the step before the profiled one, with its prediction."""
    import tensorflow as tf

    import tflms
    from tflms import _tf_internal as tfi
    from tflms import testbed
    from tflms.testing.zoo import build

    tf.config.experimental.enable_op_determinism()
    keras_model, x, y, step = build(model, batch)
    state = list(keras_model.variables) + list(step.optimizer.variables)
    initial = [v.numpy() for v in state]
    cf = tf.function(step).get_concrete_function(x, y)
    tiles = {op.name: op.outputs[0].shape.num_elements() * 4 for op in cf.graph.get_operations() if op.type == "Tile"}
    out: dict[str, Any] = {"tile_bytes": tiles}
    originals: set[str] = set()  # the ops made again with the tiles left out, by their old names
    for name, drop in (("dropped", True), ("kept", False)):
        for v, value in zip(state, initial):
            v.assign(value)
        policy = ("default", "split_sums", "drop_tiles") if drop else ("default", "split_sums")
        lms, plan = tflms.optimize(cf, device=testbed.DEVICE, host=testbed.HOST, policy=policy)
        if drop:
            remade = [op.name for op in lms.graph.get_operations() if op.name.endswith("/tflms_bcast")]
            originals = {op.removesuffix("/tflms_bcast") for op in remade}
        losses: list[float] = []
        with tf.device(testbed.DEVICE), tflms.manual_memory_optimizer():
            for _ in range(warmup + 1):
                losses.append(float(lms(x, y)))
            records, _ = tfi.profile_step(lambda lms=lms, losses=losses: losses.append(float(lms(x, y))))
        allocs = [(r["op"], r["requested"]) for r in records if r["kind"] == "alloc" and r["op"]]
        out[name] = {
            "losses": losses,
            "tiles": list(plan.tiles),
            "by_tiles": [a for a in allocs if a[0] in tiles],
            "by_remade": [a for a in allocs if a[0].endswith("/tflms_bcast")],
            "by_originals": [a for a in allocs if a[0] in originals],
        }
    out["remade"] = sorted(originals)
    return out


def remote_function_then(fail: str = "error", mib: int = 64) -> None:
    """Run a function with an op on the host worker, then fail: ``'error'`` raises ``ValueError``,
    ``'oom'`` allocates ``mib`` MiB on the device (past a smaller cap: ``ResourceExhaustedError``),
    ``'budget'`` raises the autotuner's :class:`tflms.BudgetError` for a tiny budget.

    The function made on both processes is what TensorFlow's teardown would try to remove from the
    host worker after the failure."""
    import tensorflow as tf

    from tflms import testbed

    @tf.function
    def f(x: tf.Tensor) -> tf.Tensor:
        with tf.device(testbed.HOST):
            y = x * 2.0
        return y + 1.0

    with tf.device(testbed.DEVICE):
        f(tf.ones(4))
        if fail == "oom":
            float(tf.reduce_sum(tf.ones((mib, 2**18))))
        elif fail == "budget":
            import tflms
            from tflms.testing.zoo import build

            _, x, y, step = build("cnn", 4, 16)
            tflms.function(step, device=testbed.DEVICE, host=testbed.HOST, budget=1024)(x, y)
    raise ValueError(f"failed on purpose after the remote function ran (fail={fail!r})")


def keras_mlp(
    samples: int = 256, features: int = 64, width: int = 256, depth: int = 3, unknown_size: bool = False
) -> tuple:
    """A compiled Keras MLP and its data, as a factory of ``tflms.testbed.measure_model`` returns them:
    ``(model, x, y)``, or with ``unknown_size`` ``(model, dataset)``, batches of 64 in a dataset whose
    size TensorFlow does not know (Keras cannot restart it when it runs out)."""
    import keras
    import numpy as np

    L = keras.layers
    model = keras.Sequential(
        [keras.Input((features,))] + [L.Dense(width, activation="relu") for _ in range(depth)] + [L.Dense(10)]
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, features)).astype("float32")
    y = rng.integers(0, 10, size=(samples,))
    if unknown_size:
        import tensorflow as tf

        return model, tf.data.Dataset.from_tensor_slices((x, y)).batch(64).filter(lambda x, y: True)
    return model, x, y


def cnn_step(batch: int = 16, size: int = 32) -> tuple:
    """A training step of tflms.testing.measure's CNN and its inputs, ``(step, (x, y))``: the other kind of
    factory ``tflms.testbed.measure_model`` takes."""
    from tflms.testing.zoo import build

    _, x, y, step = build("cnn", batch, size)
    return step, (x, y)


def gpt_steps(batch: int = 8, steps: int = 2, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The GPT of tflms.testing.zoo.MODELS as a user trains it (op determinism off: TensorFlow's fused
    ``SparseSoftmaxCrossEntropyWithLogits``, not its deterministic composite): one warm-up step and
    ``steps`` more, plain or (``options`` not None) rewritten by ``tflms.optimize`` with them.
    Returns the steady-state measured peak (``peak``, the warm-up excluded), ``peaks``, ``losses``,
    the predicted peak of the step that ran (``predicted``), the simulator's peak of its requested
    bytes (``requested``: :meth:`~tflms.Simulator.requested_peak`, no allocator emulation), its
    lower bound of any plan's peak (``floor``: :meth:`~tflms.Simulator.floor`) and its
    :meth:`~tflms.Simulator.unplaced` under the process's cap, if any (``unplaced``)."""
    import os

    import tensorflow as tf

    import tflms
    from tflms import testbed
    from tflms.testing.zoo import build

    _, x, y, step = build("gpt", batch)
    cf = tf.function(step).get_concrete_function(x, y)
    model = tflms.GraphModel.from_func_graph(cf.graph)
    if options is None:
        run, sim, swaps = cf, tflms.Simulator(model), ()
    else:
        run, plan = tflms.optimize(cf, device=testbed.DEVICE, host=testbed.HOST, **options)
        from tflms.plan.registry import replay

        sim, swaps = tflms.Simulator(replay(model, plan), testbed.HOST), plan.swaps
    cap = os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB")
    unplaced = sim.unplaced(swaps, int(cap) << 20) if cap else None
    peaks, losses = [], []
    with tf.device(testbed.DEVICE):
        for _ in range(1 + steps):
            testbed.reset_peak()
            losses.append(float(run(x, y)))
            peaks.append(testbed.memory()["peak"])
    predicted = sim.peak(swaps)
    return {
        "peak": max(peaks[1:]),
        "peaks": peaks,
        "losses": losses,
        "predicted": predicted,
        "requested": sim.requested_peak(swaps),
        "floor": tflms.Simulator(model).floor()[0],
        "unplaced": unplaced,
    }
