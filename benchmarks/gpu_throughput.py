"""GPU throughput: samples per second and step time, plain and with tflms, next to the timeline's predictions.

For ResNet50 224² and a GPT-style decoder (``tflms.testing.zoo.build('gpt')``: 4 causal
blocks of width 256, vocabulary 8000, sequence 512), each under one real memory cap (a logical GPU with
``memory_limit``, :func:`tflms.testing.testbed.setup_gpu`):

1. ``link``: the device-host link as the swaps take it (:func:`tflms.testing.link.probe_link`);
2. ``search``: the plain step's largest batch under the cap, among the batches :data:`MODELS`
   lists (side by side, each in a fresh process under its own cap, with no profile);
3. ``timed``, alone on the GPU, each in a fresh process: the plain step at that batch ``B``, then
   ``tflms.function`` with no budget option (``budget='auto'``: 0.9 of the cap) at ``B``, ``2B`` and
   ``3B``, with ``op_profile="auto"`` (``--op-profile``: tflms profiles its first call and plans again
   with the measured op times). Each run trains two warm-up steps, profiles one step (the per-op profile,
   :func:`tflms.testing.profile.profile_ops`, saved beside the results as
   ``gpu_profile_<model>_<mode>_b<batch>.json``), then times ``--steps`` steps, and predicts the step
   time on the timeline (:mod:`tflms.emulate.timeline`) from that profile and the probed link, and
   the peak (:class:`tflms.Simulator`).

Runs that would end after ``--deadline`` seconds are skipped, the least important last (the
order interleaves the two models). The results go to ``benchmarks/results/gpu_throughput.json``::

    {"date", "gpu", "tensorflow", "link": {...}, "runs": [{"model", "cap_mib", "mode": "plain" | "tflms",
     "batch", "status": "ok" | "oom" | "error" | "skipped", "samples_per_s", "step_ms",
     "predicted_step_ms", "measured_peak_mib", "predicted_peak_mib", ...}]}

Usage (about 8 minutes of GPU time; the TensorFlow install as for ``benchmarks/gpu.py``)::

    python benchmarks/gpu_throughput.py
    python benchmarks/gpu_throughput.py --smoke --json /tmp/smoke.json   # any machine, no GPU: seconds

``--smoke`` runs a small CNN (32²) and a small transformer (sequence 32; with ``--smoke-gpt`` the
GPT too, at sequence 64) in this process, plain at batch 2 and with tflms at 2, 4 and 6, with no
cap and no search, and the link between two logical CPUs: it checks the script, not the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MIB = 1 << 20
RESULTS = Path(__file__).resolve().parent / "results"
#: model -> (size, cap in MiB, the plain batches the search tries).
MODELS = {
    "resnet50": (224, 4096, (32, 40, 44, 48, 56)),
    "gpt": (512, 4096, (4, 8, 12, 16, 24)),
}
#: ``--smoke``'s models and sizes (``--smoke-gpt`` adds the GPT at sequence 64: a minute more on 2 CPUs).
SMOKE = {"cnn": 32, "transformer": 32}
_OOM = ("ResourceExhausted", "OOM when allocating", "out of memory", "Out of memory")


def measure_run(
    model: str,
    size: int,
    batch: int,
    mode: str,
    *,
    cap_mib: int | None,
    steps: int,
    link: dict[str, float],
    profile_dir: Path,
    gpu: bool,
    profile_step: bool = True,
    op_profile: str | None = "auto",
) -> dict[str, Any]:
    """One run in this process: train, profile one step, time ``steps`` steps; predict step time and peak."""
    import tensorflow as tf

    import tflms
    from tflms.emulate.costs import op_seconds
    from tflms.emulate.timeline import Link, TimelineModel
    from tflms.plan.registry import replay
    from tflms.testing.measure import timed_steps
    from tflms.testing.profile import profile_ops
    from tflms.testing.zoo import build

    device = "/device:GPU:0" if gpu else None
    _, x, y, train_step = build(model, batch, size)
    t0 = time.perf_counter()
    if mode == "plain":
        fn = tf.function(train_step)
        graph = tflms.GraphModel.from_func_graph(fn.get_concrete_function(x, y).graph)
        plan, step_graph, swaps, fences = None, graph, (), ()
        predicted_peak = tflms.Simulator(graph, tflms.LMSConfig().host).peak()
    else:
        fn = tflms.function(train_step, knobs=tflms.Knobs(op_profile=op_profile))  # no budget option: budget="auto"
        plan = fn.get_plan(x, y)
    plan_s = time.perf_counter() - t0
    scope = tf.device(device) if device else tf.device("/device:CPU:0")
    with scope:
        t2 = time.perf_counter()
        losses = [float(fn(x, y)), float(fn(x, y))]  # warm-up: traces, instantiates, settles the allocator
        first_calls_s = time.perf_counter() - t2  # with op_profile="auto": the profiled call and the new plan
        if plan is not None:  # op_profile="auto" planned again after the first call: the plan that ran
            plan = fn.get_plan(x, y)
            graph = plan.model
            step_graph, swaps, fences = replay(graph, plan), plan.swaps, plan.fences
            predicted_peak = plan.peak_bytes_after
        try:  # the search's attempts only ask whether a batch trains: no profile (the estimate predicts)
            profile = profile_ops(fn, (x, y), steps=1, warmup=0, device=device) if profile_step else None
            profile_error = None
        except Exception as e:  # noqa: BLE001 (a profiler that cannot run, e.g. no CUPTI: time the run anyway)
            profile, profile_error = None, f"{type(e).__name__}: {e}"[:300]
        seconds, peak = timed_steps(fn, (x, y), steps, losses, gpu)
    path = profile.save(profile_dir / f"gpu_profile_{model}_{mode}_b{batch}.json") if profile else None
    timed = TimelineModel(step_graph, op_seconds(step_graph, profile))  # no profile: the estimate
    tl = timed.run(swaps, Link(link["to_host"], link["to_device"], link["latency"]), fences)
    budget = None if plan is None else plan.options["budget"]
    return {
        "model": model,
        "size": size,
        "cap_mib": cap_mib,
        "mode": mode,
        "batch": batch,
        "status": "ok",
        "samples_per_s": round(batch / seconds, 2),
        "step_ms": round(1e3 * seconds, 2),
        "predicted_step_ms": round(1e3 * tl.step_seconds, 2),
        "predicted_compute_ms": round(1e3 * tl.compute_seconds, 2),
        "predicted_stall_ms": round(1e3 * tl.stall_seconds, 2),
        "measured_peak_mib": None if peak is None else round(peak / MIB, 1),
        "predicted_peak_mib": round(predicted_peak / MIB, 1),
        "swaps": len(swaps),
        "budget_mib": None if budget is None else round(budget / MIB, 1),
        "profile": None if path is None else str(path.relative_to(RESULTS) if path.is_relative_to(RESULTS) else path),
        "profiled_ops": len(profile) if profile else 0,
        **({"profile_error": profile_error} if profile_error else {}),
        "plan_s": round(plan_s, 1),
        "first_calls_s": round(first_calls_s, 1),
        "plan_op_profile": None if plan is None else plan.options["op_profile"],
        "losses": losses,
    }


def _link(smoke: bool) -> dict[str, Any]:
    from tflms.testing.link import probe_link

    device, host = ("/device:CPU:1", "/device:CPU:0") if smoke else ("/device:GPU:0", "/device:CPU:0")
    sizes = (1 << 12, 1 << 20, 1 << 22) if smoke else (1 << 12, 1 << 20, 1 << 24, 1 << 26)
    probe = probe_link(device, host, sizes=sizes, repeats=3 if smoke else 5, cache_dir=None)
    return {k: v for k, v in probe.to_dict().items()}


def _child(args: argparse.Namespace) -> int:
    """A fresh process for one run (``--one``) or the link probe (``--link``): the cap is set before
    TensorFlow starts, and an out-of-memory death is this process's, not the benchmark's."""
    from tflms.testing.testbed import setup_gpu

    if args.link:
        setup_gpu(None)
        print(json.dumps(_link(smoke=False)), flush=True)
        return 0
    spec = json.loads(args.one)
    setup_gpu(spec["cap_mib"] * MIB if spec["cap_mib"] else None)
    r = measure_run(
        spec["model"],
        spec["size"],
        spec["batch"],
        spec["mode"],
        cap_mib=spec["cap_mib"],
        steps=spec["steps"],
        link=spec["link"],
        profile_dir=Path(spec["profile_dir"]),
        gpu=True,
        profile_step=spec.get("profile", True),
        op_profile=spec.get("op_profile", "auto"),
    )
    print(json.dumps(r), flush=True)
    return 0


def _in_child(extra: list[str], timeout: float) -> tuple[dict | None, str]:
    """Run this script with ``extra`` in a fresh process: (its JSON result or None, its stderr's tail)."""
    from report import run_script

    return run_script(Path(__file__), extra, timeout)


def _attempt(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    result, err = _in_child(["--one", json.dumps(spec)], timeout)
    base = {k: spec[k] for k in ("model", "size", "cap_mib", "mode", "batch")}
    if result is None:
        status = "oom" if any(m in err for m in _OOM) else "error"
        result = base | {"status": status, "error": err.strip().splitlines()[-1:] if err.strip() else []}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"  {spec['model']:9} {spec['mode']:6} batch {spec['batch']:>4}: "
          + json.dumps({k: v for k, v in result.items() if k != "losses"}), flush=True)  # fmt: skip
    return result


def smoke(out: Path, steps: int, gpt: bool = False) -> dict[str, Any]:
    """The smoke run (module doc), in this process."""
    import tensorflow as tf

    try:  # two logical CPUs for the link probe (already there under the test suite's conftest)
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    except RuntimeError:  # TensorFlow's devices are set up already
        pass
    link = _link(smoke=True)
    if not all(isinstance(link[k], float) and link[k] < float("inf") for k in ("to_host", "to_device")):
        link |= {"to_host": 25e9, "to_device": 25e9, "note": "one process: a copy moves nothing; 25 GB/s assumed"}
    runs = []
    for model, size in {**SMOKE, **({"gpt": 64} if gpt else {})}.items():
        plain = measure_run(model, size, 2, "plain", cap_mib=None, steps=steps, link=link,
                            profile_dir=out.parent, gpu=False)  # fmt: skip
        runs.append(plain)
        for batch in (2, 4, 6):
            runs.append(measure_run(model, size, batch, "tflms", cap_mib=None, steps=steps, link=link,
                                    profile_dir=out.parent, gpu=False))  # fmt: skip
    return {"link": link, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny models on any machine, in this process")
    parser.add_argument("--smoke-gpt", action="store_true", help="--smoke with the GPT decoder too")
    parser.add_argument("--json", type=Path, default=RESULTS / "gpu_throughput.json")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--jobs", type=int, default=10, help="search attempts side by side")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per run")
    parser.add_argument("--deadline", type=float, default=480, help="seconds: skip runs that would end later")
    parser.add_argument("--op-profile", default="auto", type=lambda v: None if v == "estimate" else v,
                        help="what tflms plans with: 'auto' (profile the first call, plan again; default), "
                        "'estimate' (the FLOP/byte estimate), or a profile's JSON")  # fmt: skip
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--link", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one or args.link:
        return _child(args)
    import tensorflow as tf

    result: dict[str, Any] = {"benchmark": "gpu_throughput", "date": time.strftime("%Y-%m-%d"),
                              "tensorflow": tf.__version__}  # fmt: skip

    def save() -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")

    if args.smoke:
        result |= {"gpu": None, "smoke": True} | smoke(args.json, args.steps, args.smoke_gpt)
        save()
        print(f"wrote {args.json}")
        return 0
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        print("no GPU found: this benchmark measures a GPU (use --smoke to check the script); nothing measured")
        return 0
    start = time.monotonic()
    result["gpu"] = tf.config.experimental.get_device_details(gpus[0])
    print("link:", flush=True)
    link, err = _in_child(["--link"], args.timeout)
    if link is None:
        print(f"  the link probe failed ({err.strip().splitlines()[-1:]}); 25 GB/s and 10 us assumed", flush=True)
        link = {"to_host": 25e9, "to_device": 25e9, "latency": 10e-6, "note": "probe failed: assumed"}
    result["link"] = link
    result["runs"] = []
    save()
    print(f"  {json.dumps(link)}\nsearch: the plain step's largest batch under each cap", flush=True)
    common = {"steps": 1, "link": link, "profile_dir": str(args.json.parent), "op_profile": args.op_profile}
    grid = [{"model": m, "size": s, "cap_mib": cap, "mode": "plain", "batch": b, **common, "profile": False}
            for m, (s, cap, batches) in MODELS.items() for b in batches]  # fmt: skip
    with ThreadPoolExecutor(max(1, min(args.jobs, len(grid)))) as pool:
        search = list(pool.map(lambda spec: _attempt(spec, args.timeout), grid))
    result["search"] = [{k: v for k, v in r.items() if k in ("model", "batch", "status", "wall_s")} for r in search]
    save()
    largest = {
        m: max((r["batch"] for r in search if r["model"] == m and r["status"] == "ok"), default=0) for m in MODELS
    }
    print(f"  largest plain batches: {largest}\ntimed, alone:", flush=True)
    order = [(m, "plain", 1) for m in MODELS] + [(m, "tflms", 1) for m in MODELS]
    order += [(m, "tflms", k) for k in (2, 3) for m in MODELS]
    longest = max((r["wall_s"] for r in search), default=60.0)
    for model, mode, k in order:
        size, cap, _ = MODELS[model]
        batch = k * largest[model]
        spec = {"model": model, "size": size, "cap_mib": cap, "mode": mode, "batch": batch, **common,
                "steps": args.steps}  # fmt: skip
        if not batch or time.monotonic() - start + longest > args.deadline:
            why = "no plain batch trained" if not batch else f"it would end past --deadline {args.deadline:.0f} s"
            result["runs"].append({k2: spec[k2] for k2 in ("model", "size", "cap_mib", "mode", "batch")}
                                  | {"status": "skipped", "why": why})  # fmt: skip
            print(f"  {model} {mode} batch {batch}: skipped ({why})", flush=True)
        else:
            r = _attempt(spec, args.timeout)
            longest = max(longest, r["wall_s"])
            result["runs"].append(r)
        save()
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    raise SystemExit(main())
