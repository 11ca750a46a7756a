"""Pass-speed benchmark: time graph model + plan + rewrite on growing training steps.

The steps are Adam training steps of a stack of transformer encoder blocks
(MultiHeadAttention + LayerNorm + MLP) built from Keras layers; the number of
blocks sets the op count. Tracing is not timed (it is TensorFlow's work, and
the same with or without tflms). For each size it times, best of ``--repeat``:

* ``model``: :meth:`tflms.GraphModel.from_func_graph`
* ``plan``: :func:`tflms.make_plan` (candidates, groups, triggers, two simulations)
* ``rewrite``: :func:`tflms.rewrite.apply.apply_plan` + rebuild of the ConcreteFunction,
  editing the traced graph in place as ``@tflms.function`` does on its own traces
* ``copy``: the FuncGraph copy that ``tflms.optimize(cf)`` adds by default so that
  a user's function is never edited (not part of ``total``)

``--keras NAME:BATCH`` also times what ``tflms plan NAME --batch BATCH`` waits for, per run:
``build`` (the keras.applications model, 224x224x3), ``trace`` (its training step, TensorFlow's
work), ``model`` (the graph model at that batch) and ``plan`` (:func:`tflms.make_plan` with the
CLI's options: ``LMSConfig(budget="auto")``, which plans as ``budget=None`` without a GPU).
``--capacity NAME:BATCH:BUDGET`` times ``tflms plan NAME --batch BATCH --budget BUDGET --max-batch``'s
search (:func:`tflms.max_batch_size` with ``bound=True``, as the CLI calls it) after the trace.
Each runs ``--runs`` times (min and median kept: the machine may be shared, so single runs
spread); their rows go to the JSON's ``keras`` and ``capacity`` lists, replacing rows of the
same label, name and batch. ``--blocks`` with no sizes keeps the transformer rows already in
the JSON. ``--label`` names the code measured (e.g. ``before``), ``--notes`` says how.

``--policies`` times what :func:`tflms.optimize` does with the attention stack of
:data:`POLICY_STEP` (52 blocks of width 32, sequence 32, batch 8: about 51,800 ops, no tensor of
``min_bytes`` or more, so no swap) under each policy of :data:`POLICIES`, ``--runs`` times, the
policies in turn within each run: ``model`` (the graph model), ``plan`` (:func:`tflms.make_plan`,
wall and CPU seconds) and ``rewrite`` (graph copy, :func:`tflms.rewrite.apply.apply_plan` and rebuild,
only where the plan changes the step, as ``optimize`` skips it otherwise). Its rows go to the JSON's
``policies`` list, each with its machine, date, versions, the machine's load average and ``--notes``,
replacing rows of the same label and policy.

Usage::

    python benchmarks/pass_speed.py                      # sizes 1 8 32 64 blocks
    python benchmarks/pass_speed.py --blocks 1 4 --json out.json
    python benchmarks/pass_speed.py --blocks --keras ResNet152:32 --capacity ResNet50:32:16GiB --runs 3
    python benchmarks/pass_speed.py --blocks --policies --runs 3 --label after
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import keras
import tensorflow as tf
from report import save_result

import tflms
from tflms import _tf_internal as tfi
from tflms.integrations.function import paused_gc
from tflms.rewrite.apply import apply_plan
from tflms.testing.zoo import make_model, train_step_of


def transformer_step(blocks: int, seq: int = 64, dim: int = 128, batch: int = 8):
    """(concrete training step, (model, optimizer)) for ``blocks`` transformer encoder blocks.

    The model must stay referenced while the step is used: functions keep only
    weak references to variables.
    """
    keras.utils.set_random_seed(0)
    model = make_model("transformer", seq, dim=dim, heads=4, layers=blocks)
    opt = keras.optimizers.Adam(1e-3)
    step = train_step_of(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), opt)

    x = tf.zeros((batch, seq, dim))
    y = tf.zeros((batch,), tf.int32)
    return tf.function(step).get_concrete_function(x, y), (model, opt)


#: The step ``--policies`` plans: :func:`transformer_step`'s arguments.
POLICY_STEP = {"blocks": 52, "seq": 32, "dim": 32, "batch": 8}
#: The policies ``--policies`` plans it under: none, the default, and the default with the
#: passes that re-associate float sums.
POLICIES = {
    "none": "none",
    "swap_gradients": ("swap_gradients",),
    "swap_gradients,split_sums,drop_tiles": ("swap_gradients", "split_sums", "drop_tiles"),
}


def time_policies(runs: int) -> list[dict]:
    """One row per policy of :data:`POLICIES` for the step of :data:`POLICY_STEP` (see the module doc)."""
    cf, _keep_alive = transformer_step(**POLICY_STEP)
    load_before = [round(x, 2) for x in os.getloadavg()]  # the machine may be shared: its load, 1/5/15 min
    times: dict[str, dict[str, list[float]]] = {
        name: {"model": [], "plan": [], "plan_cpu": [], "rewrite": [], "total": []} for name in POLICIES
    }
    plans = {}
    for _ in range(runs):
        for name, policy in POLICIES.items():
            config = tflms.LMSConfig(device="/device:CPU:1", policy=policy)
            with paused_gc():  # as tflms.optimize does
                t0 = time.perf_counter()
                model = tflms.GraphModel.from_func_graph(cf.graph)
                t1, c1 = time.perf_counter(), time.process_time()
                plan = tflms.make_plan(model, config)
                t2, c2 = time.perf_counter(), time.process_time()
                if plan.swaps or plan.recomputes or plan.orders or plan.sums or plan.tiles:
                    graph = tfi.copy_graph(cf)
                    apply_plan(graph, plan, device=config.device, host=config.host)
                    tfi.rebuild(cf, graph)
                t3 = time.perf_counter()
            for key, value in (
                ("model", t1 - t0),
                ("plan", t2 - t1),
                ("plan_cpu", c2 - c1),
                ("rewrite", t3 - t2),
                ("total", t3 - t0),
            ):
                times[name][key].append(value)
            plans[name] = plan
            print(name, {key: round(values[-1], 2) for key, values in times[name].items()}, flush=True)
    stamp = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPUs",
        "load_average": {"start": load_before, "end": [round(x, 2) for x in os.getloadavg()]},
        "tensorflow": tf.__version__,
        "tflms": tflms.__version__,
    }
    return [
        {
            **stamp,
            "name": "attention",
            **POLICY_STEP,
            "policy": name,
            "ops": plans[name].n_ops,
            "swaps": len(plans[name].swaps),
            "sums": len(plans[name].sums),
            "tiles": len(plans[name].tiles),
            "orders": len(plans[name].orders),
            "peak_bytes_before": plans[name].peak_bytes_before,
            "peak_bytes_after": plans[name].peak_bytes_after,
            "seconds": {key: _stats(values) for key, values in times[name].items()},
        }
        for name in POLICIES
    ]


def time_pass(cf, config: tflms.LMSConfig, repeat: int) -> dict:
    best = {"model": float("inf"), "plan": float("inf"), "rewrite": float("inf"), "copy": float("inf")}
    for _ in range(repeat):
        with paused_gc():  # as tflms.optimize does
            t0 = time.perf_counter()
            model = tflms.GraphModel.from_func_graph(cf.graph)
            t1 = time.perf_counter()
            plan = tflms.make_plan(model, config)
            t2 = time.perf_counter()
            graph = tfi.copy_graph(cf)
            t3 = time.perf_counter()
            apply_plan(graph, plan, device=config.device, host=config.host)
            tfi.rebuild(cf, graph)
            t4 = time.perf_counter()
        for key, dt in (("model", t1 - t0), ("plan", t2 - t1), ("copy", t3 - t2), ("rewrite", t4 - t3)):
            best[key] = min(best[key], dt)
    best["total"] = best["model"] + best["plan"] + best["rewrite"]
    return {
        "ops": model.dag.number_of_nodes(),
        "edges": model.dag.number_of_edges(),
        "swaps": len(plan.swaps),
        "swap_ins": plan.n_swap_ins,
        "seconds": {k: round(v, 4) for k, v in best.items()},
    }


def _stats(values: list[float]) -> dict:
    return {
        "min": round(min(values), 2),
        "median": round(statistics.median(values), 2),
        "runs": [round(v, 2) for v in values],
    }


def time_keras_plan(name: str, batch: int, runs: int) -> dict:
    """What ``tflms plan NAME --batch BATCH`` waits for, ``runs`` times (see the module doc)."""
    from tflms.cli import build_model
    from tflms.ir.trace import keras_step_source, keras_train_step

    times: dict[str, list[float]] = {"build": [], "trace": [], "model": [], "plan": []}
    for _ in range(runs):
        t0 = time.perf_counter()
        keras_model = build_model(name, (224, 224, 3))
        t1 = time.perf_counter()
        step = keras_train_step(keras_model)
        if keras_step_source(keras_model, step) is not step:
            raise ValueError(f"{name}: its step must be sized by the batch alone (the CLI would trace it per batch)")
        t2 = time.perf_counter()
        model = tflms.GraphModel.from_func_graph(step.graph, batch_size=batch)
        t3 = time.perf_counter()
        plan = tflms.make_plan(model, tflms.LMSConfig(budget="auto"))
        t4 = time.perf_counter()
        for key, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[key].append(dt)
        del keras_model, step
    return {
        "name": name,
        "batch": batch,
        "ops": plan.n_ops,
        "swaps": len(plan.swaps),
        "orders": len(plan.orders),
        "peak_bytes_before": plan.peak_bytes_before,
        "peak_bytes_after": plan.peak_bytes_after,
        "seconds": {key: _stats(values) for key, values in times.items()},
    }


def time_capacity(name: str, batch: int, budget: str, runs: int) -> dict:
    """``tflms plan NAME --batch BATCH --budget BUDGET --max-batch``'s search, ``runs`` times."""
    from tflms.cli import build_model
    from tflms.config import parse_bytes
    from tflms.ir.trace import keras_step_source, keras_train_step

    times: dict[str, list[float]] = {"trace": [], "search": []}
    config = tflms.LMSConfig(budget=parse_bytes(budget, "budget"))
    for _ in range(runs):
        t0 = time.perf_counter()
        keras_model = build_model(name, (224, 224, 3))
        step = keras_train_step(keras_model)
        source = keras_step_source(keras_model, step)
        t1 = time.perf_counter()
        result = tflms.max_batch_size(source, config.budget, config=config.replace(budget=None), bound=True)
        t2 = time.perf_counter()
        times["trace"].append(t1 - t0)
        times["search"].append(t2 - t1)
        del keras_model, step, source
    return {
        "name": name,
        "batch": batch,
        "budget": budget,
        "without_lms": result.without_lms,
        "with_lms": result.with_lms,
        "bound": result.bound,
        "seconds": {key: _stats(values) for key, values in times.items()},
    }


def _merged(old: list[dict], new: list[dict], field: str = "batch") -> list[dict]:
    """``old`` with the rows of ``new`` in place of those of the same label, name and ``field``."""
    key = lambda r: (r.get("label"), r["name"], r[field])  # noqa: E731
    replaced = {key(r) for r in new}
    return [r for r in old if key(r) not in replaced] + new


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--blocks",
        type=int,
        nargs="*",
        default=[1, 8, 32, 64],
        help="transformer blocks per size (none: keep the JSON's rows)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions per size (best is kept)")
    parser.add_argument("--keras", nargs="*", default=[], metavar="NAME:BATCH", help="keras.applications steps to plan")
    parser.add_argument(
        "--capacity", nargs="*", default=[], metavar="NAME:BATCH:BUDGET", help="capacity searches (--max-batch) to time"
    )
    parser.add_argument(
        "--policies", action="store_true", help="time the 52-block attention stack under each policy (module doc)"
    )
    parser.add_argument(
        "--runs", type=int, default=3, help="runs of each --keras, --capacity and --policies row (min, median)"
    )
    parser.add_argument("--label", default="", help="what code the --keras, --capacity and --policies rows measure")
    parser.add_argument("--notes", default="", help="how they were measured (kept in the JSON)")
    parser.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results" / "pass_speed.json")
    args = parser.parse_args(argv)

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    config = tflms.LMSConfig(device="/device:CPU:1")
    old = json.loads(args.json.read_text()) if args.json.exists() else {}

    rows = [] if args.blocks else old.get("rows", [])
    if args.blocks:
        header = ("blocks", "ops", "swaps", "model s", "plan s", "rewrite s", "total s", "+copy s")
        widths = (6, 7, 6, 8, 7, 9, 8, 8)
        print(" ".join(h.rjust(w) for h, w in zip(header, widths)))
    for blocks in args.blocks:
        t0 = time.perf_counter()
        cf, _keep_alive = transformer_step(blocks)
        trace = time.perf_counter() - t0
        row = {
            "blocks": blocks,
            "trace_seconds": round(trace, 2),
            "serialize": config.knobs.serialize,
            **time_pass(cf, config, args.repeat),
        }
        s = row["seconds"]
        print(
            f"{blocks:>6} {row['ops']:>7} {row['swaps']:>6} {s['model']:>8.3f} {s['plan']:>7.3f} "
            f"{s['rewrite']:>9.3f} {s['total']:>8.3f} {s['copy']:>8.3f}",
            flush=True,
        )
        rows.append(row)
    stamp = {"label": args.label, "date": time.strftime("%Y-%m-%d %H:%M")}
    keras_rows = []
    for spec in args.keras:
        name, batch = spec.split(":")
        keras_rows.append({**stamp, **time_keras_plan(name, int(batch), args.runs)})
        print(json.dumps(keras_rows[-1]), flush=True)
    capacity_rows = []
    for spec in args.capacity:
        name, batch, budget = spec.split(":")
        capacity_rows.append({**stamp, **time_capacity(name, int(batch), budget, args.runs)})
        print(json.dumps(capacity_rows[-1]), flush=True)
    policy_rows = [{"label": args.label, **row} for row in time_policies(args.runs)] if args.policies else []
    if policy_rows and args.notes:
        policy_rows = [{**row, "notes": args.notes} for row in policy_rows]
    notes = dict(old.get("notes", {}))
    if args.notes and not policy_rows:  # --policies rows keep their notes in the rows
        notes[args.label or "rows"] = args.notes
    save_result(
        args.json,
        "pass_speed",
        rows,
        notes=notes,
        keras=_merged(old.get("keras", []), keras_rows),
        capacity=_merged(old.get("capacity", []), capacity_rows),
        policies=_merged(old.get("policies", []), policy_rows, field="policy"),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
