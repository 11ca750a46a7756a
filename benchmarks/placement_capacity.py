"""Placement capacity (simulator): how much larger a model fits when its step is placed on 2 or 4 devices.

For each model, device memory budget and number of devices K it reports the largest size whose
*predicted* largest device peak fits the budget when the step is placed by tflms's placer
(``devices=[...]``, :mod:`tflms.plan.passes.place`; copy-only ops on the host where that lowers
the largest device peak; no swaps), next to the plain single-device
step's largest size (predicted, recomputed here) and, from ``results/capacity.json``, swapping
alone on one device (predicted, with that file's date and settings). Every figure is a prediction
of the tflms simulator, not a measurement.

Models (the ones of ``benchmarks/capacity.py``, Adam, float32):

* ``unet3d``: the 3D U-Net, the largest cubic input side at batch 1 (multiples of 16);
* ``resnet152``: keras.applications ResNet-152, 224x224x3, the largest batch;
* ``transformer``: the zoo's transformer (``tflms.testing.zoo``: width 256, 2 blocks, sequence 256;
  a BERT-ish encoder small enough to trace per batch quickly), the largest batch.

Each placement is chosen by the placer's search (requested bytes) and checked with the allocator
emulation per device (``Stage.peak_bytes``). Variables and the update live on ``devices[0]``. For
the 3D U-Net on 2 devices it also reports the placement with swaps planned per device within the
budget, as ``tflms.function(step, devices=..., budget=...)`` plans and the rewrite applies them
(:func:`tflms.integrations.placement.placed_swap_plan`).

Usage::

    python benchmarks/placement_capacity.py                    # all models, 16 GiB, 2 and 4 devices
    python benchmarks/placement_capacity.py --models unet3d --devices 2
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import keras
from capacity import BATCH_MODELS, unet_side_step
from report import save_result

import tflms
from tflms.config import parse_bytes
from tflms.integrations.placement import placed_swap_plan
from tflms.ir.trace import keras_step_source, keras_train_step
from tflms.plan.capacity import graph_source, largest_fitting
from tflms.plan.passes.place import REFINE as REFINE_DEFAULT
from tflms.plan.passes.place import device_stages, place

RESULTS = Path(__file__).resolve().parent / "results"
SIDE_STEP = 16
HOST = "/device:CPU:0"


#: ``place``'s ``refine`` for the run (``--refine``).
REFINE = [REFINE_DEFAULT]


def largest_peak(model: tflms.GraphModel, k: int) -> int:
    """The largest predicted device peak of the placer's placement of ``model`` on ``k`` devices
    (copy-only ops on the host where that lowers it)."""
    stages = place(model, [f"/device:GPU:{i}" for i in range(k)], refine=REFINE[0], host=HOST)
    return max(st.peak_bytes for st in device_stages(stages, HOST))


def swapped_peak(model: tflms.GraphModel, k: int, budget: int) -> int:
    """The largest predicted device peak of ``model`` placed on ``k`` devices with swaps planned per
    device within ``budget``, as ``devices=`` with a budget plans them and the rewrite applies them
    (:func:`tflms.integrations.placement.placed_swap_plan`)."""
    config = tflms.LMSConfig(
        devices=[f"/device:GPU:{i}" for i in range(k)], host=HOST, budget=budget, on_budget_miss="best"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tflms.LMSWarning)
        return placed_swap_plan(model, config).peak_bytes_after


def _timed_fits(label: str, size: int, fits: bool, t0: float) -> bool:
    print(f"  {label} {size}: {'fits' if fits else 'does not fit'} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return fits


def unet_rows(budget: int, label: str, ks: list[int], rel_tol: float) -> list[dict]:
    """The 3D U-Net's largest side (batch 1) plain and placed on each of ``ks`` devices."""
    models: dict[int, tflms.GraphModel] = {}

    def model_at(n: int) -> tflms.GraphModel:
        if n not in models:
            cf, _keep = unet_side_step(n * SIDE_STEP)
            models[n] = tflms.GraphModel.from_func_graph(cf.graph, batch_size=1)
        return models[n]

    def plain_fits(n: int) -> bool:
        t0 = time.perf_counter()
        return _timed_fits("plain side", n * SIDE_STEP, tflms.Simulator(model_at(n)).peak() <= budget, t0)

    t0 = time.perf_counter()
    plain = SIDE_STEP * largest_fitting(plain_fits, 1024 // SIDE_STEP, rel_tol, start=208 // SIDE_STEP)
    rows = [_row("unet3d", label, budget, "side (b=1)", 1, plain, plain, time.perf_counter() - t0)]
    for k in ks:

        def placed_fits(n: int, k: int = k) -> bool:
            t0 = time.perf_counter()
            return _timed_fits(f"side on {k} devices", n * SIDE_STEP, largest_peak(model_at(n), k) <= budget, t0)

        t0 = time.perf_counter()
        placed = SIDE_STEP * largest_fitting(placed_fits, 1024 // SIDE_STEP, rel_tol, start=plain // SIDE_STEP)
        rows.append(_row("unet3d", label, budget, "side (b=1)", k, placed, plain, time.perf_counter() - t0))
        if k != 2:
            continue

        def swapped_fits(n: int, k: int = k) -> bool:
            t0 = time.perf_counter()
            fits = swapped_peak(model_at(n), k, budget) <= budget
            return _timed_fits(f"side on {k} devices with swaps per device", n * SIDE_STEP, fits, t0)

        t0 = time.perf_counter()
        swapped = SIDE_STEP * largest_fitting(swapped_fits, 1024 // SIDE_STEP, rel_tol, start=placed // SIDE_STEP)
        row = _row("unet3d", label, budget, "side (b=1)", k, swapped, plain, time.perf_counter() - t0)
        row["way"] = f"placed on {k} devices, then swaps planned per device (applied by the rewrite)"
        rows.append(row)
    return rows


def _batch_source(name: str):
    """``(graph_of(batch) -> GraphModel, the Keras model to keep alive)`` for a batch model."""
    keras.utils.set_random_seed(0)
    if name == "transformer":
        from tflms.testing.zoo import MODELS

        model = MODELS["transformer"][0](256)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-4),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=False,
        )
    else:
        model = BATCH_MODELS[name]()
    return graph_source(keras_step_source(model, keras_train_step(model))), model


def batch_rows(name: str, budget: int, label: str, ks: list[int], rel_tol: float, swap: bool) -> list[dict]:
    """A batch model's largest batch plain (and with swapping alone, ``swap``) and placed on each of ``ks``."""
    graph_of, _keep = _batch_source(name)
    cache: dict[int, tflms.GraphModel] = {}

    def model_of(b: int) -> tflms.GraphModel:
        if b not in cache:
            cache.clear()  # one size at a time: the models of large steps are large
            cache[b] = graph_of(b)
        return cache[b]

    t0 = time.perf_counter()

    def plain_fits(b: int) -> bool:
        t1 = time.perf_counter()
        return _timed_fits("plain batch", b, tflms.Simulator(model_of(b)).peak() <= budget, t1)

    plain = largest_fitting(plain_fits, 1 << 14, rel_tol, start=16)
    rows = [_row(name, label, budget, "batch", 1, plain, plain, time.perf_counter() - t0)]
    if swap:
        t0 = time.perf_counter()
        result = tflms.max_batch_size(_keep, budget, rel_tol=rel_tol, limit=1 << 14)
        rows.append({**_row(name, label, budget, "batch", 1, result.with_lms, plain, time.perf_counter() - t0),
                     "way": "swapping alone (tflms.max_batch_size, default policy)"})  # fmt: skip
    for k in ks:

        def placed_fits(b: int, k: int = k) -> bool:
            t1 = time.perf_counter()
            return _timed_fits(f"batch on {k} devices", b, largest_peak(model_of(b), k) <= budget, t1)

        t0 = time.perf_counter()
        placed = largest_fitting(placed_fits, 1 << 14, rel_tol, start=max(1, plain) * k)
        rows.append(_row(name, label, budget, "batch", k, placed, plain, time.perf_counter() - t0))
    return rows


def _row(model: str, label: str, budget: int, what: str, k: int, size: int, plain: int, seconds: float) -> dict:
    return {
        "model": model,
        "budget": label,
        "budget_bytes": budget,
        "measure": what,
        "devices": k,
        "way": "plain step, one device" if k == 1 else f"placed on {k} devices (tflms placer, no swaps)",
        "largest": size,
        "ratio_to_plain": round(size / plain, 2) if plain else None,
        **({"refine": REFINE[0]} if k > 1 else {}),
        "seconds": round(seconds, 1),
    }


def swapping_rows(budget_label: str) -> list[dict]:
    """Swapping alone on one device, from ``results/capacity.json`` (predicted there), for the models here."""
    path = RESULTS / "capacity.json"
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    out = []
    for r in data["rows"]:
        if r["model"] in ("unet3d", "resnet152") and r["budget"] == budget_label:
            flags = [k for k in ("serialize", "swap_gradients", "split_sums", "drop_tiles") if r.get(k)]
            out.append(
                {
                    "model": r["model"],
                    "budget": r["budget"],
                    "measure": r["measure"],
                    "devices": 1,
                    "way": f"swapping alone, from capacity.json ({', '.join(flags) or 'no options'})",
                    "largest": r["with_lms"],
                    "plain_there": r["without_lms"],
                    "planned": r.get("planned", data["date"]),
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["unet3d", "transformer", "resnet152"], help="which models")
    parser.add_argument("--budgets", nargs="+", default=["16GiB"], help="device memory budgets, each device's")
    parser.add_argument("--devices", nargs="+", type=int, default=[2, 4], help="numbers of devices")
    parser.add_argument("--rel-tol", type=float, default=0.02, help="search precision (default 2%%)")
    parser.add_argument("--swap", action="store_true", help="also search swapping alone for the transformer (minutes)")
    parser.add_argument(
        "--refine", type=int, default=REFINE_DEFAULT, help="place()'s refine: cuts simulated before choosing"
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "placement_capacity.json")
    args = parser.parse_args(argv)
    REFINE[0] = args.refine
    rows: list[dict] = []
    print("all figures: tflms simulator predictions (not measured)")
    for label in args.budgets:
        budget = parse_bytes(label, "budget")
        for name in args.models:
            print(f"{name} at {label} per device:", flush=True)
            if name == "unet3d":
                new = unet_rows(budget, label, args.devices, args.rel_tol)
            else:
                new = batch_rows(name, budget, label, args.devices, args.rel_tol, args.swap and name == "transformer")
            for r in new:
                print(f"  -> {r['way']}: {r['measure']} {r['largest']} (x{r['ratio_to_plain']})", flush=True)
            rows += new
        rows += swapping_rows(label)
    if args.json.exists():  # keep the rows of the (model, budget) pairs not run this time
        done = {(m, b) for m in args.models for b in args.budgets}
        old = json.loads(args.json.read_text())["rows"]
        rows = [r for r in old if (r["model"], r["budget"]) not in done or "capacity.json" in r["way"]] + rows
        rows = list({json.dumps(r, sort_keys=True): r for r in rows}.values())  # the copied rows once
    save_result(
        args.json, "placement_capacity", rows,
        source="tflms simulator (predicted largest device peak), not a measurement",
        rel_tol=args.rel_tol,
        notes=(
            "Placement by tflms.plan.passes.place (stages of consecutive forward ops, backward ops with their "
            "forward op, variables and the optimizer update on devices[0]); no swaps on top. The unet3d rows let "
            "copy-only ops (ConcatV2, Slice...) run on the host where that lowers the largest device peak, and "
            "their 'swaps planned per device' row is what devices= with a budget plans and the rewrite applies "
            "(tflms.integrations.placement.placed_swap_plan). Each size's placement "
            "is checked with the allocator emulation per device. 'transformer' is tflms.testing.zoo's "
            "(width 256, 2 blocks, sequence 256), a BERT-like encoder far smaller than BERT-base. "
            "Swapping-alone rows for unet3d and resnet152 "
            "are copied from capacity.json (their own date)."
        ),
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
