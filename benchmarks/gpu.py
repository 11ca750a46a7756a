"""GPU benchmark: real device peak vs predicted, largest batch under a real cap, step time, link bandwidth.

Runs only where a GPU is present (never in CI). Every attempt is a fresh subprocess
(an out-of-memory error can leave TensorFlow's allocator unusable) that trains a
``keras.applications`` model (Adam, synthetic data, ``weights=None``) at one batch size
and reports the real device peak (``tf.config.experimental.get_memory_info('GPU:0')``,
steady steps after two warm-up steps; the warm-up steps' own peak too) next to the simulator's
predicted peak. A failed attempt keeps its plan's figures (``planned``); one that never ran on
the GPU (``start_failed``: it died before its first op there) bounds no search.

``--cap`` makes the GPU's memory a real cap of that size (a logical device with
``memory_limit``: TensorFlow's BFC allocator gets that much and no more), so the largest
batch is found in seconds per attempt on any GPU size. The attempts of one search round
run side by side (``--jobs``), each under its own cap; the timed runs run alone.

Modes: ``plain`` (``tf.function``), ``tflms`` (``tflms.function`` with default options: since
2026-11-26 ``swapout_window='auto'``, two swap-outs in flight on a GPU), ``fenced`` (the same
with ``swapout_window=--window``) and ``budget`` (``tflms.function(budget=fraction * cap)``:
autotuned to the cap). A *variant* adds modifiers to a mode (:func:`parse_variant`):
``tflms/w0`` has no fences (the default before 2026-11-26), ``tflms/w4`` four swap-outs in
flight, ``tflms/p8`` bounds how many kernels the executor enqueues ahead of the GPU
(``GPUOptions.experimental.kernel_tracker_max_pending``, set when TensorFlow starts), and the
letters ``g``, ``s``, ``o``, ``r``, ``t``, ``l`` turn on the options that are off by default
(``swap_gradients``, ``split_sums``, ``order_updates``, ``recompute``, ``drop_tiles``, which needs
``s``, and ``layout_optimizer``: the step runs with TensorFlow's layout optimizer, as the plain
step does, not with it off): ``budget/g/s``.

Phases, each written to the JSON as it ends:

1. ``bandwidth`` (unless ``--skip-bandwidth``): host->device and device->host copy rate of
   one 256 MiB tensor;
2. ``compare`` (with ``--compare``): the variants listed, side by side at ``--compare-batch``,
   each under ``--compare-cap`` (far above its peak, so that no peak is clipped);
3. ``search``: the largest batch that trains under the cap, plain and budget (a grid, then
   one round between the largest batch that fits and the smallest that does not, or above
   it, up to twice it, when every batch tried fit: :func:`next_batches`); the
   budget runs take ``--search-modifiers`` (``auto``: those of the compare run with the lowest
   measured / predicted peak);
4. ``timed`` (unless ``--skip-timed``): alone on the GPU (under ``--timed-cap``), plain, ``tflms/w0`` (no fences),
   tflms (default options) and tflms with the search's modifiers (unless the default has them) at the
   largest plain batch, and budget at its largest:
   step time, measured and predicted peak, bytes over the link per step and the rate that
   makes over the step.

``--deadline`` skips the runs that would end after it. Usage::

    python benchmarks/gpu.py --cap 4GiB                      # ResNet50 224x224
    python benchmarks/gpu.py --model ResNet152 --cap 8GiB --plain 16,24,32 --budget 48,64,96
    python benchmarks/gpu.py --skip-bandwidth --compare plain,tflms/w0,tflms/w1,tflms/w2,tflms/p8 \\
        --search-modifiers auto --plain 44,46 --budget 88,96,112,128 --timed-cap 12GiB
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MIB = 1 << 20


def _gpu_setup(cap: int | None, max_pending: int = 0) -> None:
    """Cap the GPU's memory at ``cap`` bytes (else memory growth); ``max_pending`` > 0 bounds how far
    the executor enqueues kernels ahead of the GPU (``GPUOptions.experimental.kernel_tracker_max_pending``),
    which TensorFlow reads only when it creates its context, so this must run first."""
    import tensorflow as tf

    if max_pending:
        from tensorflow.python.framework import ops  # the config can only be given to a new context

        config = tf.compat.v1.ConfigProto()
        config.gpu_options.experimental.kernel_tracker_max_pending = max_pending
        ops.enable_eager_execution_internal(config=config)
    from tflms.testing.testbed import setup_gpu

    setup_gpu(cap or None)


#: Modes of a probe; a variant adds modifiers: ``tflms/w2/p8`` is ``tflms`` with ``swapout_window=2``
#: and ``kernel_tracker_max_pending=8``; ``w0`` is ``swapout_window=None`` (no fences; without a
#: ``w``, the default ``'auto'``: fences on a GPU). ``fenced`` is ``tflms/w<--window>``.
MODES = ("plain", "tflms", "fenced", "budget")
#: Modifiers of one letter: a plan option that is off by default, turned on.
OPTION_FLAGS = {
    "g": "swap_gradients",
    "s": "split_sums",
    "o": "order_updates",
    "r": "recompute",
    "t": "drop_tiles",
    "l": "layout_optimizer",
}


def parse_variant(spec: str) -> tuple[str, dict]:
    """``'budget/w2/p8/g'`` -> ``('budget', {'window': 2, 'max_pending': 8, 'flags': 'g'})``.

    >>> parse_variant("tflms/w4")
    ('tflms', {'window': 4, 'max_pending': 0, 'flags': ''})
    >>> parse_variant("budget/s/g")
    ('budget', {'window': -1, 'max_pending': 0, 'flags': 'gs'})
    """
    mode, *mods = spec.split("/")
    if mode not in MODES:
        raise argparse.ArgumentTypeError(f"variant {spec!r}: mode {mode!r} is not one of {', '.join(MODES)}")
    out = {"window": -1, "max_pending": 0, "flags": ""}  # -1: swapout_window left at its default
    seen = set()
    for m in mods:
        key = m if m in OPTION_FLAGS else {"w": "window", "p": "max_pending"}.get(m[:1])
        number = m[1:].isascii() and m[1:].isdigit() and key in ("window", "max_pending")
        if key in seen or not (number or m in OPTION_FLAGS) or mode == "plain" and key != "max_pending":
            raise argparse.ArgumentTypeError(
                f"variant {spec!r}: modifier {m!r} is not, once each, wN (swapout_window, w0: None; not for "
                "plain), pN (kernel_tracker_max_pending) or, not for plain, one of "
                + ", ".join(f"{k} ({v})" for k, v in OPTION_FLAGS.items())
            )
        seen.add(key)
        if number:
            out[key] = int(m[1:])
        else:
            out["flags"] = "".join(sorted(out["flags"] + m))
    if "t" in out["flags"] and "s" not in out["flags"]:
        raise argparse.ArgumentTypeError(f"variant {spec!r}: modifier 't' (drop_tiles) needs 's' (split_sums) too")
    return mode, out


def bandwidth(nbytes: int = 256 * MIB, reps: int = 5) -> dict:
    """Host->device and device->host copy rate (GB/s) of one ``nbytes`` float32 tensor, eager."""
    import numpy as np
    import tensorflow as tf

    _gpu_setup(None)
    tf.zeros(1).numpy()
    print(STARTED, flush=True)
    data = np.ones(nbytes // 4, dtype=np.float32)
    rates: dict[str, list[float]] = {"host_to_device_GBps": [], "device_to_host_GBps": []}
    for i in range(reps + 1):
        with tf.device("/CPU:0"):
            host = tf.constant(data)  # a new handle: TensorFlow keeps a copy per device of each
        t0 = time.perf_counter()
        with tf.device("/GPU:0"):
            dev = tf.identity(host) * 1.0  # a new device tensor, for the same reason
            float(tf.reduce_sum(dev[:1]))  # waits for the copy
        t1 = time.perf_counter()
        with tf.device("/CPU:0"):
            back = tf.identity(dev)
        back.numpy()
        t2 = time.perf_counter()
        if i:  # the first is a warm-up
            rates["host_to_device_GBps"].append(nbytes / (t1 - t0) / 1e9)
            rates["device_to_host_GBps"].append(nbytes / (t2 - t1) / 1e9)
    return {k: round(max(v), 2) for k, v in rates.items()} | {"bytes": nbytes}


def probe(
    model_name: str,
    size: int,
    batch: int,
    mode: str,
    steps: int,
    cap: int | None,
    budget: int,
    window: int = -1,
    max_pending: int = 0,
    flags: str = "",
) -> dict:
    """Train ``steps`` timed steps at ``batch`` in ``mode``; return measurements (in a subprocess).

    Prints :data:`STARTED` once TensorFlow runs on the GPU, and :data:`PLANNED` with the plan's
    figures before the first step, so that an attempt that fails later keeps them."""
    _gpu_setup(cap, max_pending)
    import keras
    import numpy as np
    import tensorflow as tf

    import tflms
    from tflms.config import keyword_options
    from tflms.testing.measure import timed_steps
    from tflms.testing.zoo import train_step_of

    # The GPU's context: an attempt that fails before this never ran (see failed_attempt). It proves
    # no more than that: cuBLAS/cuDNN handles come later, outside the capped pool, so a failure
    # after it can still be the neighbours' doing.
    tf.zeros(1).numpy()
    print(STARTED, flush=True)

    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, model_name)(weights=None, input_shape=(size, size, 3), classes=1000)
    step = train_step_of(model, keras.losses.SparseCategoricalCrossentropy(), keras.optimizers.Adam(1e-4))

    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(batch, size, size, 3)).astype("float32"))
    y = tf.constant(rng.integers(0, 1000, size=(batch,)).astype("int32"))
    t0 = time.perf_counter()
    if mode == "plain":
        fn = tf.function(step)
        cf = fn.get_concrete_function(x, y)
        plan = None  # the plain step's prediction needs no plan: the simulator's peak of its graph
        predicted = tflms.Simulator(tflms.GraphModel.from_func_graph(cf.graph), tflms.LMSConfig().host).peak()
    else:
        options = {"budget": budget} if mode == "budget" else {}
        options |= {"swapout_window": window or None} if window >= 0 else {}  # -1: the default
        options |= {OPTION_FLAGS[f]: True for f in flags}
        fn = tflms.function(step, **keyword_options(options))  # swapout_window into knobs=tflms.Knobs(...)
        plan = fn.get_plan(x, y)
        predicted = plan.peak_bytes_after
    plan_s = time.perf_counter() - t0
    planned = _planned(plan, predicted)
    print(PLANNED + json.dumps(planned), flush=True)
    t0 = time.perf_counter()
    losses = [float(fn(x, y))]
    first_s = time.perf_counter() - t0
    losses.append(float(fn(x, y)))
    warmup_peak = int(tf.config.experimental.get_memory_info("GPU:0")["peak"])
    seconds, peak = timed_steps(fn, (x, y), steps, losses)
    link = sum(s.bytes * (1 + len(s.swap_ins)) for s in plan.swaps) if plan else 0
    return {
        "ok": True,
        "batch": batch,
        "mode": mode,
        "step_ms": round(1000 * seconds, 2),
        "images_per_s": round(batch / seconds, 1),
        "measured_peak_bytes": peak,
        "warmup_peak_bytes": warmup_peak,
        **planned,
        **({"swapout_window": plan.options["swapout_window"]} if plan else {}),
        **({"kernel_tracker_max_pending": max_pending} if max_pending else {}),
        **({"options_on": [OPTION_FLAGS[f] for f in flags]} if flags else {}),
        **({"budget_bytes": budget} if mode == "budget" else {}),
        "cap_bytes": cap,
        "link_bytes_per_step": link,
        "link_GBps_over_step": round(link / seconds / 1e9, 2),
        "predicted_link_ms": round(1000 * plan.link_seconds, 2) if plan else 0.0,
        "plan_s": round(plan_s, 1),
        "first_step_s": round(first_s, 1),
        "losses": losses,
    }


#: A probe's stdout lines: TensorFlow runs on the GPU; the plan's figures (JSON) before the first step.
STARTED, PLANNED = "probe started on the GPU", "planned: "


def _planned(plan: object | None, predicted: int) -> dict:
    """A plan's figures (none for the plain step): predicted peak, swaps (``gradient_swaps``: of
    tensors not made by a forward op of the step, e.g. a split sum's chain; None where the plan
    has no model), fences, orders, split sums, recomputes."""
    if plan is None:
        return {"predicted_peak_bytes": int(predicted), "swaps": 0, "fences": 0, "recomputes": 0}
    model = plan.model  # the step before the sums are split: their chains' ops are not in it
    forward = {op for op in model.dag if model.phase(op) == "forward"} if model is not None else None
    return {
        "predicted_peak_bytes": int(predicted),
        "swaps": len(plan.swaps),
        "gradient_swaps": None if forward is None else sum(s.producer not in forward for s in plan.swaps),
        "fences": len(plan.fences),
        "orders": len(plan.orders),
        "sums": len(plan.sums),
        "recomputes": len(plan.recomputes),
    }


def _subprocess(args: argparse.Namespace, extra: list[str], timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--model", args.model, "--image-size", str(args.image_size), *extra]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # its partial output comes as bytes

        def text(out: str | bytes | None) -> str:
            return out.decode(errors="replace") if isinstance(out, bytes) else out or ""

        failed = failed_attempt(text(e.stderr) + f"\ntimed out after {timeout:.0f} s", -9, text(e.stdout))
        return failed | {"oom": False, "timed_out": True}
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return failed_attempt(r.stderr, r.returncode, r.stdout)


def failed_attempt(stderr: str, returncode: int, stdout: str) -> dict:
    """A failed attempt's record: out of memory under its cap, or not; ``start_failed`` where it
    never ran on the GPU (no :data:`STARTED` line: on an H200 beside a process holding TensorFlow's
    default share of its memory, "cudaSetDevice() on GPU:0 failed. Status: out of memory", or an
    abort), which says nothing about its cap; ``planned``: the plan's figures, if it got that far;
    ``failed_at``: the node TensorFlow names in its error (an out-of-memory's op).

    >>> failed_attempt("InternalError: cudaSetDevice() on GPU:0 failed. Status: out of memory", 1, "")["start_failed"]
    True
    >>> lines = [STARTED, PLANNED + '{"swaps": 3}']
    >>> r = failed_attempt("ResourceExhaustedError: OOM when allocating", 1, chr(10).join(lines))
    >>> r["oom"], r["planned"], "start_failed" in r
    (True, {'swaps': 3}, False)
    >>> failed_attempt("Detected at node a/Mul-1-Transpose-LayoutOptimizer defined at (most", 1, STARTED)["failed_at"]
    'a/Mul-1-Transpose-LayoutOptimizer'
    """
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    first = next((ln.strip()[:500] for ln in lines if "Error" in ln or "error:" in ln), None)
    out = {"ok": False, "returncode": returncode, "first_error": first, "error": lines[-3:]}
    at = next((ln.split("Detected at node ", 1)[1].split()[0] for ln in lines if "Detected at node " in ln), None)
    out |= {"failed_at": at} if at else {}
    if STARTED not in stdout.splitlines():
        return out | {"oom": False, "start_failed": True}
    planned = [json.loads(ln[len(PLANNED) :]) for ln in stdout.splitlines() if ln.startswith(PLANNED)]
    oom = any(s in stderr for s in ("ResourceExhausted", "OOM", "out of memory"))
    return out | {"oom": oom} | ({"planned": planned[-1]} if planned else {})


def attempt(args: argparse.Namespace, batch: int, spec: str, steps: int | None = None, cap: int | None = None) -> dict:
    """One probe of ``spec`` (see :func:`parse_variant`) at ``batch`` in a fresh process, under ``cap``
    (default ``--cap``); a budget is ``--fraction`` of ``--cap`` whatever the process's cap."""
    mode, mods = parse_variant(spec)
    window = args.window if mode == "fenced" and mods["window"] < 0 else mods["window"]
    extra = ["--probe", "--batch", str(batch), "--mode", mode, "--steps", str(steps or args.steps),
             "--cap", str(cap or args.cap), "--budget-bytes", str(int(args.fraction * args.cap)),
             "--window", str(window), "--max-pending", str(mods["max_pending"]), "--flags", mods["flags"]]  # fmt: skip
    t0 = time.perf_counter()
    r = _subprocess(args, extra, args.timeout)
    r.update(batch=batch, mode=mode, variant=spec, wall_s=round(time.perf_counter() - t0, 1))
    print(f"  {spec:12} batch {batch:>4}: " + json.dumps({k: v for k, v in r.items() if k != "losses"}), flush=True)
    return r


def _parallel(args: argparse.Namespace, jobs: list[tuple[int, str]], cap: int | None = None) -> list[dict]:
    with ThreadPoolExecutor(max(1, min(args.jobs, len(jobs)))) as pool:
        return list(pool.map(lambda j: attempt(args, *j, cap=cap), jobs))


def largest_trained(runs: list[dict], spec: str) -> tuple[int, int | None]:
    """(largest batch that trained, smallest batch above it that did not) of variant ``spec``; an
    attempt that never started on the GPU (``start_failed``) says nothing either way."""
    ok = [r["batch"] for r in runs if r["variant"] == spec and r["ok"]]
    best = max(ok, default=0)
    failed = [
        r["batch"]
        for r in runs
        if r["variant"] == spec and not r["ok"] and not r.get("start_failed") and r["batch"] > best
    ]
    return best, min(failed, default=None)


def next_batches(best: int, fail: int | None, n: int) -> list[int]:
    """The batches of the search's second round for one variant: ``n`` between the largest batch
    that trained (``best``) and the smallest above it that did not (``fail``); when every batch
    tried trained (``fail`` is None), ``n`` above it, up to twice ``best``; none when nothing
    trained or nothing lies between.

    >>> next_batches(44, 48, 3)
    [45, 46, 47]
    >>> next_batches(160, None, 4)
    [192, 224, 256, 288]
    >>> next_batches(30, 31, 4), next_batches(0, 16, 4)
    ([], [])
    """
    if not best:
        return []
    top = fail if fail is not None else 2 * best + 1
    return sorted({best + (top - best) * (i + 1) // (n + 1) for i in range(n)} - {best, top})


def _best_modifiers(runs: list[dict]) -> str:
    """The modifiers (``'/w2'``, ``'/p8'``, ...) of the rewritten run in ``runs`` with the lowest
    measured / predicted peak, or ``''`` if none ran."""
    ok = [r for r in runs if r["ok"] and r["mode"] != "plain"]
    if not ok:
        return ""
    best = min(ok, key=lambda r: (r["measured_peak_bytes"] / r["predicted_peak_bytes"], r["step_ms"]))
    return best["variant"][len(best["mode"]) :] if best["mode"] != "fenced" else f"/w{best['swapout_window'] or 0}"


def main(argv: list[str] | None = None) -> int:
    from tflms.config import GPU_SWAPOUT_WINDOW, parse_bytes

    def variants(text: str) -> list[str]:
        specs = [v for v in text.split(",") if v]
        for v in specs:
            parse_variant(v)
        return specs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ResNet50", help="keras.applications name (default ResNet50)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--cap", type=parse_bytes, default=parse_bytes("4GiB"), help="real device memory cap")
    parser.add_argument("--fraction", type=float, default=0.9, help="budget mode: budget = fraction * cap")
    parser.add_argument("--window", type=int, default=2, help="fenced mode: swapout_window (default 2)")
    parser.add_argument("--skip-bandwidth", action="store_true", help="no bandwidth phase")
    parser.add_argument("--compare", type=variants, default=[],
                        help="variants to run side by side first, e.g. plain,tflms,tflms/w2,tflms/p8")  # fmt: skip
    parser.add_argument("--compare-batch", type=int, default=44, help="batch of the --compare runs")
    parser.add_argument("--compare-cap", type=parse_bytes, default=parse_bytes("12GiB"),
                        help="cap of each --compare run (far above its peak: the peak is not clipped)")  # fmt: skip
    parser.add_argument("--plain", default="24,32,40,48,56,64", help="plain batches of the first round")
    parser.add_argument("--budget", default="64,80,96,112,128,160,192", help="budget batches of the first round")
    parser.add_argument("--search-modifiers", default="",
                        help="modifiers of the budget and tflms runs ('/w2', '/p8', '/g/s/o': see parse_variant); "
                        "'auto': those of the --compare run with the lowest measured / predicted peak")  # fmt: skip
    parser.add_argument("--steps", type=int, default=3, help="measured steps per search attempt")
    parser.add_argument("--timed-steps", type=int, default=10, help="measured steps per timed run")
    parser.add_argument("--skip-timed", action="store_true", help="no timed phase: stop after the search")
    parser.add_argument("--timed-cap", type=parse_bytes, default=None,
                        help="cap of the timed runs (default --cap; above the peaks, none is clipped)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=8, help="search attempts side by side")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per attempt")
    parser.add_argument("--deadline", type=float, default=0, help="seconds: skip runs that would end later")
    parser.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results" / "gpu.json")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bandwidth", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--budget-bytes", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--max-pending", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--flags", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.search_modifiers != "auto":
        if args.search_modifiers and not args.search_modifiers.startswith("/"):
            parser.error(f"--search-modifiers must start with '/' (e.g. '/g/s'). Received: {args.search_modifiers!r}")
        try:
            parse_variant("budget" + args.search_modifiers)
        except argparse.ArgumentTypeError as e:
            parser.error(f"--search-modifiers {args.search_modifiers!r}: {e}")
    if args.bandwidth:
        print(json.dumps(bandwidth()), flush=True)
        return 0
    if args.probe:
        budget = args.budget_bytes or int(args.fraction * args.cap)
        r = probe(args.model, args.image_size, args.batch, args.mode, args.steps, args.cap, budget,
                  args.window, args.max_pending, args.flags)  # fmt: skip
        print(json.dumps(r), flush=True)
        return 0

    start = time.monotonic()
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        print("no GPU found: this benchmark measures real GPU memory and runs only on a GPU machine; nothing measured")
        return 0
    result: dict = {
        "benchmark": "gpu",
        "date": time.strftime("%Y-%m-%d"),
        "gpu": tf.config.experimental.get_device_details(gpus[0]),
        "tensorflow": tf.__version__,
        "model": args.model,
        "image_size": args.image_size,
        "cap_bytes": args.cap,
        "budget_fraction": args.fraction,
        "budget_bytes": int(args.fraction * args.cap),
    }

    def save() -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")

    def late(seconds: float) -> bool:
        return bool(args.deadline) and time.monotonic() - start + seconds > args.deadline

    if not args.skip_bandwidth:
        print("bandwidth:", flush=True)
        result["bandwidth"] = _subprocess(args, ["--bandwidth"], args.timeout)
        print("  " + json.dumps(result["bandwidth"]), flush=True)
        save()
    modifiers = "" if args.search_modifiers == "auto" else args.search_modifiers
    if args.compare:
        print(f"side by side at batch {args.compare_batch}, each under a {args.compare_cap / MIB:,.0f} MiB cap:")
        result["compare_cap_bytes"] = args.compare_cap
        result["compare"] = _parallel(args, [(args.compare_batch, v) for v in args.compare], args.compare_cap)
        save()
        if args.search_modifiers == "auto":
            modifiers = _best_modifiers(result["compare"])
            print(f"  lowest measured / predicted: modifiers {modifiers!r}", flush=True)
    parse_variant("budget" + modifiers)
    result["search_modifiers"] = modifiers
    print(f"search under a {args.cap / MIB:,.0f} MiB cap:", flush=True)
    budget_spec = "budget" + modifiers
    grid = [(int(b), "plain") for b in args.plain.split(",") if b]
    grid += [(int(b), budget_spec) for b in args.budget.split(",") if b]
    runs = _parallel(args, grid) if grid else []
    refine: list[tuple[int, str]] = []
    for spec in ("plain", budget_spec):
        refine += [(b, spec) for b in next_batches(*largest_trained(runs, spec), max(1, args.jobs // 2))]
    longest = max((r["wall_s"] for r in runs), default=0.0)
    if refine and late(2 * longest):
        print(f"  no second round: it would leave too little time before --deadline {args.deadline:.0f} s", flush=True)
    elif refine:
        runs += _parallel(args, refine)
    result["search"] = runs
    plain_max, _ = largest_trained(runs, "plain")
    budget_max, _ = largest_trained(runs, budget_spec)
    result["max_batch_plain"], result["max_batch_budget"] = plain_max, budget_max
    save()
    print(f"largest batch under the cap: plain {plain_max}, tflms ({budget_spec}) {budget_max}", flush=True)
    if args.skip_timed:
        print(f"wrote {args.json}")
        return 0
    timed_cap = args.timed_cap or args.cap
    print(f"timed, alone, each under a {timed_cap / MIB:,.0f} MiB cap:", flush=True)
    timed: list[dict] = []
    longest = max((r["wall_s"] for r in runs), default=0.0) / 2  # an attempt alone takes less
    batch = plain_max or args.compare_batch
    # tflms: the default options ('auto': fences on a GPU); w0: the same plan without fences.
    same = modifiers in ("", f"/w{GPU_SWAPOUT_WINDOW}")  # what the default already runs on a GPU
    specs = ["plain", "tflms/w0", "tflms"] + ([] if same else ["tflms" + modifiers])
    todo = [(batch, spec) for spec in specs] + ([(budget_max, budget_spec)] if budget_max else [])
    for batch, spec in todo:
        if late(longest):
            print(f"  {spec} batch {batch}: skipped, it would end past --deadline {args.deadline:.0f} s", flush=True)
            continue
        timed.append(attempt(args, batch, spec, args.timed_steps, timed_cap))
        longest = max(longest, timed[-1]["wall_s"])
        result["timed"] = timed
        save()
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    raise SystemExit(main())
