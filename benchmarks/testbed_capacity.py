"""Capacity under a real memory cap, measured on the two-process test bed.

For each model: the largest batch whose training step runs under a real cap
(``TF_CPU_BFC_MEM_LIMIT_IN_MB`` in the measured process; see tflms/testbed.py),
plain and with tflms autotuned to ``budget = fraction * cap``, next to the
simulator's prediction of the same two numbers (``tflms.max_batch_size``). Each
probe is a fresh measured process that trains ``--steps`` steps; an out-of-memory
death counts as "does not fit", and so does a budget the autotuner cannot meet.

Usage::

    python benchmarks/testbed_capacity.py --models resnet50 --cap 600MiB
    python benchmarks/testbed_capacity.py --models transformer --cap 400MiB --start 16
    python benchmarks/testbed_capacity.py --models encoder --cap 800MiB --start 8
    python benchmarks/testbed_capacity.py --models encoder --cap 800MiB --start 8 --swapout-window 4
    python benchmarks/testbed_capacity.py --models resnet50 --cap 600MiB --start 16 --no-serialize
    python benchmarks/testbed_capacity.py --models resnet50 --cap 600MiB --start 16 --swap-gradients
    python benchmarks/testbed_capacity.py --models densenet121 --cap 400MiB --start 28 --split-sums
    python benchmarks/testbed_capacity.py --models resnet50 --predicted-only  # the predicted columns only

Rows of earlier runs for other models are kept in the JSON (each row has its own cap); a
run with ``--swapout-window`` (the tflms probes plan with fences), ``--no-serialize`` (without
ordering edges), ``--swap-gradients`` (backward tensors swapped too) or ``--split-sums`` (gradient
sums added as their terms arrive) has rows of its own.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from report import policy_of, save_result

from tflms.config import LMSConfig, parse_bytes
from tflms.plan.capacity import largest_fitting
from tflms.testbed import DEVICE_NICE, oom_message
from tflms.testing.measure import measure
from tflms.testing.zoo import MODELS


def predicted(
    model: str,
    size: int | None,
    cap: int,
    limit: int,
    serialize: bool = True,
    swap_gradients: bool = False,
    split_sums: bool = False,
    order_updates: bool = False,
    drop_tiles: bool = False,
) -> tuple[int, int, int]:
    """(plain, with LMS, bound) largest batch whose *predicted* peak fits ``cap`` (simulator); the bound:
    the largest batch whose ``Simulator.floor`` (variables and one op's working set) fits, past which no
    plan fits.

    The step is traced as the measured processes trace it: per batch, with static shapes
    (traced with an unknown batch, the transformers' ``Dense`` layers reshape to ``(None,
    None)``, which no plan swaps: the encoder's plans then fit batch 42 in 720 MiB where the
    measured process's fit 60), and with op determinism on, as ``measure_step`` does, which
    changes the graph (a deterministic sparse cross-entropy: ResNet50 96² has 14,618 ops
    with it, 14,480 without) and so the plans the autotuner finds.
    """
    import tensorflow as tf

    tf.config.experimental.enable_op_determinism()

    import tflms
    from tflms.testing.zoo import build

    _, x, y, step = build(model, 1, size)
    traced = tf.function(step)

    def at(batch: int) -> tf.types.experimental.ConcreteFunction:
        return traced.get_concrete_function(
            tf.TensorSpec((batch, *x.shape[1:]), x.dtype), tf.TensorSpec((batch,), y.dtype)
        )

    r = tflms.max_batch_size(
        at, cap, limit=limit, rel_tol=0.05, knobs=tflms.Knobs(serialize=serialize), bound=True,
        policy=policy_of(
            swap_gradients=swap_gradients, split_sums=split_sums, order_updates=order_updates, drop_tiles=drop_tiles
        ),
    )  # fmt: skip
    return r.without_lms, r.with_lms, r.bound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet50"], choices=sorted(MODELS))
    parser.add_argument("--cap", default="600MiB", help="real memory cap of the measured process")
    parser.add_argument("--start", type=int, default=8, help="first batch tried (the search goes both ways)")
    parser.add_argument("--fraction", type=float, default=0.9, help="tflms budget as a fraction of the cap")
    parser.add_argument("--size", type=int, help="image side / sequence length (default: the model's)")
    parser.add_argument("--steps", type=int, default=2, help="steps per probe (default 2)")
    parser.add_argument("--limit", type=int, default=512, help="largest batch tried")
    parser.add_argument("--rel-tol", type=float, default=0.1, help="bisection precision (default 10%%)")
    parser.add_argument(
        "--swapout-window", type=int, metavar="N", help="tflms probes plan with swapout_window=N (fences)"
    )
    parser.add_argument(
        "--serialize",
        action=argparse.BooleanOptionalAction,
        default=LMSConfig().knobs.serialize,
        help="tflms probes plan with ordering edges (serialize=True, the default) or without (--no-serialize)",
    )
    parser.add_argument(
        "--order-updates",
        action="store_true",
        help="tflms probes plan with order_updates=True (each variable update waits for the reads of that "
        "variable still held; off by default in tflms); rows of their own",
    )
    parser.add_argument(
        "--swap-gradients",
        action="store_true",
        help="tflms probes plan with swap_gradients=True (tensors of the backward pass swapped too); rows of their own",
    )
    parser.add_argument(
        "--split-sums",
        action="store_true",
        help="tflms probes plan with split_sums=True (gradient AddN sums as chains of AddV2); rows of their own",
    )
    parser.add_argument(
        "--drop-tiles",
        action="store_true",
        help="tflms probes plan with drop_tiles=True (gradient Tiles of a per-channel value left out and "
        "broadcast; needs --split-sums); rows of their own",
    )
    parser.add_argument(
        "--predicted-only",
        action="store_true",
        help="recompute only the predicted columns of the JSON's rows of --models (at each row's cap and size)",
    )
    args = parser.parse_args()
    cap = parse_bytes(args.cap, "cap")
    path = Path(__file__).parent / "results" / "testbed_capacity.json"
    if args.predicted_only:
        old = json.loads(path.read_text())
        for r in old["rows"]:
            if r["model"] in args.models:
                r["predicted_plain"], r["predicted_lms"], r["predicted_bound"] = predicted(
                    r["model"], r["size"], r["cap"], args.limit, r.get("serialize", False),
                    r.get("swap_gradients", False), r.get("split_sums", False), r.get("order_updates", False),
                    r.get("drop_tiles", False),
                )  # fmt: skip
                r["predicted_on"] = time.strftime("%Y-%m-%d")
                print(
                    f"{r['model']}: predicted {r['predicted_plain']} plain, {r['predicted_lms']} with tflms, "
                    f"no plan past {r['predicted_bound']}"
                )
        path.write_text(json.dumps(old, indent=2) + "\n")
        print(f"wrote {path}")
        return
    rows = []
    for name in args.models:
        t0 = time.perf_counter()
        log: list[dict] = []

        def fits(batch: int, lms: bool, name: str = name, log: list = log) -> bool:
            options = {
                "budget": int(cap * args.fraction),
                "swapout_window": args.swapout_window,
                "serialize": args.serialize,
                "policy": policy_of(
                    swap_gradients=args.swap_gradients,
                    split_sums=args.split_sums,
                    order_updates=args.order_updates,
                    drop_tiles=args.drop_tiles,
                ),
            }
            kw = {"modes": ["lms"], "options": options} if lms else {"modes": ["plain"]}
            r = measure(name, batch, size=args.size, steps=args.steps, cap=cap, timeout=1800, **kw)
            ok = r.ok
            probe = {"batch": batch, "lms": lms, "status": r.status, "seconds": round(r.seconds, 1)}
            held = ""
            if r.oom and "in_use" in r.oom:  # what the allocator held when it ran out (MiB)
                probe["oom"] = {k: round(r.oom[k] / 2**20, 1) for k in ("requested", "in_use", "free", "largest_free")}
                held = ", {in_use} MiB in use, {largest_free} MiB largest free chunk for {requested} MiB".format(
                    **probe["oom"]
                )
            elif r.status == "oom" and (said := oom_message(r.error or "")):  # no allocator dump: what TF said
                probe["oom_message"] = said
                held = f": {said}"
            if ok:  # what trained: its measured peak, and the plan's prediction and size
                v = r.value["lms" if lms else "plain"]
                probe.update(peak_mib=round(v["peak"] / 2**20, 1), predicted_mib=round(v["predicted"] / 2**20, 1))
                if lms:
                    probe.update(n_swaps=v["n_swaps"], n_orders=v["n_orders"], n_recomputes=v["n_recomputes"])
            elif r.error and r.status != "oom":  # e.g. the autotuner's BudgetError (log lines may follow it)
                lines = r.error.strip().splitlines()
                raised = [line for line in lines if "Error: " in line and not line.startswith(("E0000", "W0000"))]
                probe["error"] = (raised or lines)[-1][:2000]  # the whole line: a BudgetError ends with its budget
            log.append(probe)
            mode = "tflms" if lms else "plain"
            print(f"  {name} batch {batch} {mode}: {r.status}{held} ({r.seconds:.0f} s)", flush=True)
            return ok

        plain = largest_fitting(lambda b: fits(b, False), args.limit, args.rel_tol, start=args.start)
        with_lms = largest_fitting(lambda b: fits(b, True), args.limit, args.rel_tol, start=max(plain, 1) * 2)
        pred_plain, pred_lms, pred_bound = predicted(
            name, args.size, cap, args.limit, args.serialize, args.swap_gradients, args.split_sums, args.order_updates,
            args.drop_tiles,
        )  # fmt: skip
        rows.append(
            {
                "model": name,
                "size": args.size or MODELS[name][1],
                "cap": cap,
                "fraction": args.fraction,
                "swapout_window": args.swapout_window,
                "serialize": args.serialize,
                **({"swap_gradients": True} if args.swap_gradients else {}),
                **({"split_sums": True} if args.split_sums else {}),
                **({"order_updates": True} if args.order_updates else {}),
                **({"drop_tiles": True} if args.drop_tiles else {}),
                "plain": plain,
                "lms": with_lms,
                "ratio": round(with_lms / plain, 2) if plain else None,
                "predicted_plain": pred_plain,
                "predicted_lms": pred_lms,
                "predicted_bound": pred_bound,
                "probes": log,
                "seconds": round(time.perf_counter() - t0),
                "date": time.strftime("%Y-%m-%d"),
                "device_nice": DEVICE_NICE,
                "memory_optimizer": "auto",  # measure's default: tflms steps at MANUAL, as tflms calls them
            }
        )
    if path.exists():  # keep the other models' rows: each model may have its own cap

        def setting(r: dict) -> tuple:
            return (
                r["model"], r.get("swapout_window"), r.get("serialize", False), r.get("swap_gradients", False),
                r.get("split_sums", False), r.get("order_updates", False), r.get("drop_tiles", False),
                r.get("fraction"),
            )  # fmt: skip

        done = {setting(r) for r in rows}
        old = json.loads(path.read_text())
        # Rows from before per-row dates were measured at the file's date, at equal priority.
        kept = [{"date": old["date"], "device_nice": 0, **r} for r in old["rows"] if setting(r) not in done]
        rows = kept + rows
    print("\nlargest batch under a real cap (measured, two-process test bed)")
    head = ("model", "cap MiB", "size", "plain", "tflms", "ratio", "pred. plain", "pred. tflms")
    print("{:<12} {:>8} {:>5} {:>6} {:>6} {:>6} {:>12} {:>12}".format(*head))
    for r in rows:
        ratio = f"x{r['ratio']:.1f}" if r["ratio"] else "-"
        print(
            f"{r['model']:<12} {r['cap'] / 2**20:>8.0f} {r['size']:>5} {r['plain']:>6} {r['lms']:>6} {ratio:>6} "
            f"{r['predicted_plain']:>12} {r['predicted_lms']:>12}"
        )
    save_result(
        path,
        "testbed_capacity",
        rows,
        steps=args.steps,
        rel_tol=args.rel_tol,
        where="measured: two-process test bed (CPU device with BFC allocator and a real cap, host process over gRPC)",
    )


if __name__ == "__main__":
    main()
