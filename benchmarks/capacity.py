"""Capacity benchmark (simulator): how much larger a batch or input fits with LMS.

For each model and device memory budget it reports the largest batch (for the
3D U-Net: the largest cubic input side at batch 1) whose *predicted* device peak
fits, without LMS and with the autotuned LMS plan. All figures are predictions of
the tflms simulator (tflms/simulator.py), not measurements on a GPU.

Models (Adam, float32, ``weights=None``):

* ResNet-50, ResNet-152, DenseNet-121 (keras.applications, 224x224x3, 1000 classes)
* a BERT-base-sized encoder from Keras layers (12 layers, hidden 768, 12 heads,
  FFN 3072, sequence 512, vocabulary 30522)
* a 3D U-Net-like model (Conv3D 32-64-128-256 encoder/decoder with skips, 1 channel)

Usage::

    python benchmarks/capacity.py                          # all models, 16 and 80 GiB
    python benchmarks/capacity.py --models resnet50 --budgets 16GiB
    python benchmarks/capacity.py --models resnet50 --no-serialize   # LMS with serialize=False
    python benchmarks/capacity.py --models resnet152 --swap-gradients  # backward tensors swapped too
    python benchmarks/capacity.py --models densenet121 --swap-gradients --split-sums  # sums as terms arrive

The JSON keeps the rows of the models not run. BERT-base is traced per batch with static
shapes (``tflms.ir.trace.keras_step_source``): traced with an unknown batch, its ``Dense``
layers reshape to ``(None, None)``, which no plan swaps.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import keras
import tensorflow as tf
from report import policy_of, save_result

import tflms
from tflms.config import parse_bytes
from tflms.ir.trace import keras_step_source, keras_train_step


def _compile(model: keras.Model) -> keras.Model:
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="sparse_categorical_crossentropy")
    return model


def resnet50() -> keras.Model:
    return _compile(keras.applications.ResNet50(weights=None))


def resnet152() -> keras.Model:
    return _compile(keras.applications.ResNet152(weights=None))


def densenet121() -> keras.Model:
    return _compile(keras.applications.DenseNet121(weights=None))


def bert_base(seq: int = 512, vocab: int = 30522, dim: int = 768, layers: int = 12, heads: int = 12) -> keras.Model:
    L = keras.layers
    tokens = keras.Input((seq,), dtype="int32")
    h = L.Embedding(vocab, dim)(tokens) + L.Embedding(seq, dim)(tf.range(seq))
    h = L.LayerNormalization()(h)
    for _ in range(layers):
        a = L.MultiHeadAttention(num_heads=heads, key_dim=dim // heads)(h, h)
        h = L.LayerNormalization()(h + L.Dropout(0.1)(a))
        f = L.Dense(dim * 4, activation="gelu")(h)
        h = L.LayerNormalization()(h + L.Dropout(0.1)(L.Dense(dim)(f)))
    out = L.Dense(2)(L.Dense(dim, activation="tanh")(h[:, 0]))
    model = keras.Model(tokens, out)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def unet3d(side: int, base: int = 32, depth: int = 4) -> keras.Model:
    L = keras.layers
    inp = keras.Input((side, side, side, 1))
    h, skips = inp, []
    for d in range(depth):
        f = base * 2**d
        h = L.Conv3D(f, 3, padding="same", activation="relu")(h)
        h = L.Conv3D(f, 3, padding="same", activation="relu")(h)
        if d < depth - 1:
            skips.append(h)
            h = L.MaxPooling3D()(h)
    for d in reversed(range(depth - 1)):
        f = base * 2**d
        h = L.Conv3DTranspose(f, 2, strides=2)(h)
        h = L.Concatenate()([h, skips[d]])
        h = L.Conv3D(f, 3, padding="same", activation="relu")(h)
        h = L.Conv3D(f, 3, padding="same", activation="relu")(h)
    out = L.Conv3D(2, 1)(h)
    model = keras.Model(inp, out)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


BATCH_MODELS = {"resnet50": resnet50, "resnet152": resnet152, "densenet121": densenet121, "bert_base": bert_base}


def unet_side_step(side: int):
    """Training step of the 3D U-Net at one cubic side (batch unknown, sized 1)."""
    model = unet3d(side)
    return keras_train_step(model, label_shape=(side, side, side), label_dtype="int32"), model


def largest_side(
    budget: int,
    lms: bool,
    step: int = 16,
    limit: int = 1024,
    rel_tol: float = 0.02,
    serialize: bool = True,
    swap_gradients: bool = False,
    split_sums: bool = False,
    drop_tiles: bool = False,
    order_updates: bool = False,
) -> int:
    """Largest multiple of ``step`` for the 3D U-Net side that fits ``budget`` at batch 1."""
    from tflms.plan.autotune import serialized_search
    from tflms.plan.capacity import largest_fitting
    from tflms.plan.registry import prepare

    def fits(k: int) -> bool:
        cf, _keep = unet_side_step(k * step)
        model = tflms.GraphModel.from_func_graph(cf.graph, batch_size=1)
        sim = tflms.Simulator(model, "/device:CPU:0")
        if sim.peak() <= budget:
            return True
        policy = policy_of(
            swap_gradients=swap_gradients, split_sums=split_sums, drop_tiles=drop_tiles, order_updates=order_updates
        )
        config = tflms.LMSConfig(knobs=tflms.Knobs(serialize=serialize), policy=policy)
        if lms:  # the step make_plan plans on
            model, sim, *_ = prepare(model, config, sim)
        return lms and serialized_search(model, config, sim, budget)[0] is not None

    return step * largest_fitting(fits, limit // step, rel_tol)


def side_bound(budget: int, start: int, step: int = 16, limit: int = 1024) -> int:
    """Largest multiple of ``step`` for the 3D U-Net side whose floor (``Simulator.floor``) fits ``budget``,
    searched exactly from ``start``: past it no plan fits."""
    from tflms.plan.capacity import largest_fitting

    def fits(k: int) -> bool:
        cf, _keep = unet_side_step(k * step)
        model = tflms.GraphModel.from_func_graph(cf.graph, batch_size=1)
        return tflms.Simulator(model, "/device:CPU:0").floor()[0] <= budget

    return step * largest_fitting(fits, limit // step, start=max(1, start // step))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[*BATCH_MODELS, "unet3d"], help="which models")
    parser.add_argument("--budgets", nargs="+", default=["16GiB", "80GiB"], help="device memory budgets")
    parser.add_argument("--rel-tol", type=float, default=0.02, help="search precision (default 2%%)")
    parser.add_argument(
        "--serialize",
        action=argparse.BooleanOptionalAction,
        default=tflms.LMSConfig().knobs.serialize,
        help="LMS plans with ordering edges (serialize=True, the default) or without (--no-serialize); each "
        "setting has rows of its own",
    )
    parser.add_argument(
        "--swap-gradients",
        action="store_true",
        help="LMS plans that may swap tensors of the backward pass too (swap_gradients=True; off by default in "
        "tflms); rows of their own",
    )
    parser.add_argument(
        "--split-sums",
        action="store_true",
        help="LMS plans on the step whose gradient AddN sums of 3+ terms are chains of AddV2 (split_sums=True; "
        "off by default in tflms); rows of their own",
    )
    parser.add_argument(
        "--drop-tiles",
        action="store_true",
        help="LMS plans on the step whose gradient Tiles of a per-channel value are left out and broadcast "
        "(drop_tiles=True, needs --split-sums; off by default in tflms); rows of their own",
    )
    parser.add_argument(
        "--order-updates",
        action="store_true",
        help="LMS plans whose variable updates wait for the reads of their variable (order_updates=True; off "
        "by default in tflms); rows of their own",
    )
    parser.add_argument(
        "--bound-only",
        action="store_true",
        help="only search each row's bound (the largest size whose Simulator.floor fits) and add it to "
        "the JSON's rows of that model and budget",
    )
    parser.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results" / "capacity.json")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models) - set(BATCH_MODELS) - {"unet3d"})
    if unknown:
        parser.error(f"unknown models: {', '.join(unknown)}; choose from {', '.join([*BATCH_MODELS, 'unet3d'])}")
    budgets = [parse_bytes(b, "budget") for b in args.budgets]

    if args.bound_only:
        return _bounds_only(args, budgets)
    rows = []
    print("all figures: tflms simulator predictions (not measured)")
    print(f"{'model':<12} {'budget':>7} {'what':<10} {'no LMS':>7} {'LMS':>7} {'ratio':>6} {'bound':>7} {'seconds':>8}")
    for name in args.models:
        keras.utils.set_random_seed(0)
        if name != "unet3d":
            model = BATCH_MODELS[name]()
            # BERT's Dense layers leave forward sizes unknown when traced with an unknown batch:
            # then it is traced per batch (see tflms.ir.trace.keras_step_source).
            step = keras_step_source(model, keras_train_step(model))
        for budget, label in zip(budgets, args.budgets):
            t0 = time.perf_counter()
            if name == "unet3d":
                what = "side (b=1)"
                base, lms = (
                    largest_side(budget, False, rel_tol=args.rel_tol),
                    largest_side(
                        budget,
                        True,
                        rel_tol=args.rel_tol,
                        serialize=args.serialize,
                        swap_gradients=args.swap_gradients,
                        split_sums=args.split_sums,
                        drop_tiles=args.drop_tiles,
                        order_updates=args.order_updates,
                    ),  # fmt: skip
                )
                bound = side_bound(budget, lms)
            else:
                what = "batch"
                result = tflms.max_batch_size(
                    step, budget, rel_tol=args.rel_tol, limit=1 << 15, bound=True,
                    knobs=tflms.Knobs(serialize=args.serialize),
                    policy=policy_of(
                        swap_gradients=args.swap_gradients, split_sums=args.split_sums, drop_tiles=args.drop_tiles,
                        order_updates=args.order_updates,
                    ),
                )  # fmt: skip
                base, lms, bound = result.without_lms, result.with_lms, result.bound
            seconds = time.perf_counter() - t0
            ratio = lms / base if base else None
            rows.append(
                {
                    "model": name,
                    "budget": label,
                    "budget_bytes": budget,
                    "measure": what,
                    "without_lms": base,
                    "with_lms": lms,
                    "ratio": round(ratio, 2) if ratio else None,
                    "bound": bound,
                    "serialize": args.serialize,
                    **({"swap_gradients": True} if args.swap_gradients else {}),
                    **({"split_sums": True} if args.split_sums else {}),
                    **({"drop_tiles": True} if args.drop_tiles else {}),
                    **({"order_updates": True} if args.order_updates else {}),
                    "seconds": round(seconds, 1),
                    "rel_tol": args.rel_tol,
                    "planned": time.strftime("%Y-%m-%d"),  # rows of other models keep their own date
                }
            )
            ratio_text = f"x{ratio:.2f}" if ratio else "-"
            print(
                f"{name:<12} {label:>7} {what:<10} {base:>7} {lms:>7} {ratio_text:>6} {bound:>7} {seconds:>8.0f}",
                flush=True,
            )
    if args.json.exists():  # keep the rows of the models (and settings) not run this time

        def setting(r: dict) -> tuple:
            return (
                r["model"], r.get("serialize", False), r.get("swap_gradients", False), r.get("split_sums", False),
                r.get("drop_tiles", False), r.get("order_updates", False),
            )  # fmt: skip

        done = {setting(r) for r in rows}
        previous = json.loads(args.json.read_text())
        rel_tol = previous["rel_tol"]  # the file's precision; a row searched at another one says so
        old = [{**r, "rel_tol": r.get("rel_tol", rel_tol)} for r in previous["rows"]]
        rows = [r for r in old if setting(r) not in done] + rows
        rank = {name: i for i, name in enumerate([*BATCH_MODELS, "unet3d"])}
        rows.sort(key=lambda r: (rank.get(r["model"], len(rank)), *setting(r)[1:]))
    else:
        rel_tol = args.rel_tol
    save_result(
        args.json, "capacity", rows,
        source="tflms simulator (predicted device peak), not a GPU measurement", rel_tol=rel_tol,
    )  # fmt: skip
    return 0


def _bounds_only(args: argparse.Namespace, budgets: list[int]) -> int:
    """``--bound-only``: each (model, budget)'s bound, written into the JSON's rows of it."""
    if not args.json.exists():
        raise SystemExit(f"--bound-only adds bounds to the rows of {args.json}, which does not exist")
    data = json.loads(args.json.read_text())
    print("all figures: tflms simulator predictions (not measured)")
    for name in args.models:
        keras.utils.set_random_seed(0)
        step = None
        if name != "unet3d":
            model = BATCH_MODELS[name]()
            step = keras_step_source(model, keras_train_step(model))
        for budget in budgets:
            rows = [r for r in data["rows"] if r["model"] == name and r["budget_bytes"] == budget]
            if not rows:
                print(f"{name} {budget}: no row in {args.json}; run it without --bound-only first")
                continue
            t0 = time.perf_counter()
            start = max(r["with_lms"] for r in rows)
            if step is None:
                bound = side_bound(budget, start)
            else:
                bound = tflms.plan.capacity.batch_bound(step, budget, limit=1 << 15, start=start)
            for r in rows:
                r["bound"] = bound
            print(f"{name:<12} {rows[0]['budget']:>7} bound {bound:>7} {time.perf_counter() - t0:>8.0f} s", flush=True)
    meta = {k: v for k, v in data.items() if k not in ("benchmark", "rows", "date", "machine", "tensorflow", "tflms")}
    save_result(args.json, "capacity", data["rows"], **meta)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    raise SystemExit(main())
