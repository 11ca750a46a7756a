"""GPU: a GPT-style decoder of about a billion parameters trained with its optimizer on the host, under a cap.

The zoo's GPT (``tflms.testing.zoo.build('gpt', width=..., layers=...)``: causal self-attention,
Adam; by default width 2048, 20 blocks, sequence 512, batch 4: 1.04 B parameters, whose weights,
gradients and Adam state take 16.6 GB in float32) on GPU 0, each run in a fresh process:

1. ``plain`` without a cap: the reference step time and losses;
2. ``plain`` under ``--cap`` (a logical GPU with ``memory_limit``): runs out of memory where the
   cap is below the weights, gradients and Adam state;
3. ``offload`` under ``--cap``: ``tflms.function(step, offload="optimizer")`` (the Adam state made
   on the host, ``budget="auto"``: 0.9 of the cap, swaps where the plan needs them).

Each run trains one warm-up step and ``--steps`` timed ones from the same seed and data, then the
offload run profiles one more step: the host update's time (the ops tflms placed on the host: the
sum of their times, and the span from the first to the last). Writes
``benchmarks/results/gpu_offload.json``::

    {"benchmark", "date", "gpu", "tensorflow", "tflms", "model": {"width", "layers", "seq",
     "batch", "parameters"}, "cap_mib", "runs": [{"mode", "cap_mib", "status", "step_ms",
     "samples_per_s", "measured_peak_mib", "predicted_peak_mib", "host_update_ms",
     "host_update_span_ms", "losses", ...}], "max_loss_diff"}

Usage (a few minutes of GPU time; TensorFlow installed as for ``benchmarks/gpu.py``)::

    python benchmarks/gpu_offload.py                       # cap 16 GiB
    python benchmarks/gpu_offload.py --cap 12GiB --layers 16
    python benchmarks/gpu_offload.py --smoke --json /tmp/smoke.json   # any machine, no GPU: seconds

``--smoke`` trains a small GPT in this process, the device and the host being two logical CPUs,
without a cap: it checks the script, not a GPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20
RESULT = Path(__file__).resolve().parent / "results" / "gpu_offload.json"
_OOM = ("ResourceExhausted", "OOM when allocating", "out of memory", "Out of memory")


def measure(spec: dict[str, Any], device: str | None, host: str) -> dict[str, Any]:
    """One run in this process (module doc): train, time, and for ``offload`` profile the host update."""
    import tensorflow as tf

    import tflms
    from tflms import _tf_internal as tfi
    from tflms._devices import same_device
    from tflms.testing.measure import timed_steps
    from tflms.testing.zoo import build

    offload = spec["mode"] == "offload"
    model, x, y, step = build(
        "gpt",
        spec["batch"],
        spec["seq"],
        width=spec["width"],
        layers=spec["layers"],
        offload_host=host if offload else None,
    )
    t0 = time.perf_counter()
    if offload:
        fn = tflms.function(step, device=device, host=host, offload="optimizer")
        plan = fn.get_plan(x, y)
        predicted = plan.peak_bytes_after
    else:
        fn = tf.function(step)
        plan = None
        predicted = tflms.Simulator(tflms.GraphModel.from_func_graph(fn.get_concrete_function(x, y).graph), host).peak()
    plan_s = time.perf_counter() - t0
    scope = tf.device(device) if device else tf.device("/device:CPU:0")
    gpu = device is not None and "GPU" in device
    with scope:
        losses = [float(fn(x, y))]  # warm-up
        seconds, peak = timed_steps(fn, (x, y), spec["steps"], losses, gpu)
        host_ms = span_ms = None
        if offload:
            on_host = {
                op.name
                for op in fn.get_concrete_function(x, y).graph.get_operations()
                if op.device and same_device(op.device, host)
            }
            records = [k for k in tfi.profile_kernels(lambda: losses.append(float(fn(x, y)))) if k["op"] in on_host]
            if records:
                host_ms = 1e3 * sum(k["duration_ns"] for k in records) * 1e-9
                span_ms = 1e-6 * (
                    max(k["time_ns"] + k["duration_ns"] for k in records) - min(k["time_ns"] for k in records)
                )
    return {
        "mode": spec["mode"],
        "cap_mib": spec["cap_mib"],
        "status": "ok",
        "step_ms": round(1e3 * seconds, 2),
        "samples_per_s": round(spec["batch"] / seconds, 3),
        "measured_peak_mib": None if peak is None else round(peak / MIB, 1),
        "predicted_peak_mib": round(predicted / MIB, 1),
        "swaps": None if plan is None else len(plan.swaps),
        "budget": None if plan is None else plan.budget_text,
        "host_update_ms": None if host_ms is None else round(host_ms, 2),
        "host_update_span_ms": None if span_ms is None else round(span_ms, 2),
        "plan_s": round(plan_s, 1),
        "losses": losses,
        "parameters": int(model.count_params()),
    }


def _child(spec: dict[str, Any]) -> int:
    from tflms.testing.testbed import setup_gpu

    setup_gpu(spec["cap_mib"] * MIB if spec["cap_mib"] else None)
    print(json.dumps(measure(spec, "/device:GPU:0", "/device:CPU:0")), flush=True)
    return 0


def _attempt(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    from report import run_script

    t0 = time.perf_counter()
    result, err = run_script(Path(__file__), ["--one", json.dumps(spec)], timeout)
    if result is None:
        status = "oom" if any(m in err for m in _OOM) else "error"
        result = {"mode": spec["mode"], "cap_mib": spec["cap_mib"], "status": status,
                  "error": err.strip().splitlines()[-1:] if err.strip() else []}  # fmt: skip
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    shown = {k: v for k, v in result.items() if k != "losses"}
    print(f"  {spec['mode']:8} cap {spec['cap_mib']}: {json.dumps(shown)}", flush=True)
    return result


def _loss_diff(runs: list[dict[str, Any]]) -> float | None:
    ref = next((r for r in runs if r["mode"] == "plain" and not r["cap_mib"] and r["status"] == "ok"), None)
    off = next((r for r in runs if r["mode"] == "offload" and r["status"] == "ok"), None)
    if ref is None or off is None:
        return None
    n = min(len(ref["losses"]), len(off["losses"]))
    return max(abs(a - b) for a, b in zip(ref["losses"][:n], off["losses"][:n]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", default="16GiB", help="the device cap of the capped runs (default 16GiB)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--timeout", type=int, default=420, help="seconds per run")
    parser.add_argument("--json", type=Path, default=RESULT)
    parser.add_argument("--smoke", action="store_true", help="a small GPT on two logical CPUs, in this process")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        return _child(json.loads(args.one))
    import tensorflow as tf

    import tflms
    from tflms.config import parse_bytes

    model = {"width": args.width, "layers": args.layers, "seq": args.seq, "batch": args.batch}
    if args.smoke:
        model = {"width": 64, "layers": 2, "seq": 16, "batch": 2}
    base = {**model, "steps": args.steps}
    result: dict[str, Any] = {"benchmark": "gpu_offload", "date": time.strftime("%Y-%m-%d"),
                              "tensorflow": tf.__version__, "tflms": tflms.__version__}  # fmt: skip
    if args.smoke:
        try:
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        except RuntimeError:  # already set up (the test suite's conftest)
            pass
        runs = [
            measure({**base, "mode": m, "cap_mib": None}, "/device:CPU:1", "/device:CPU:0")
            for m in ("plain", "offload")
        ]
        result |= {"gpu": None, "smoke": True, "cap_mib": None}
    else:
        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            print("no GPU found: this benchmark measures a GPU (use --smoke to check the script); nothing measured")
            return 0
        cap_mib = parse_bytes(args.cap, "cap") // MIB
        result |= {"gpu": tf.config.experimental.get_device_details(gpus[0]), "cap_mib": cap_mib}
        runs = [
            _attempt({**base, "mode": mode, "cap_mib": cap}, args.timeout)
            for mode, cap in (("plain", None), ("plain", cap_mib), ("offload", cap_mib))
        ]
    parameters = next((r["parameters"] for r in runs if r.get("parameters")), None)
    result |= {"model": {**model, "parameters": parameters}, "runs": runs, "max_loss_diff": _loss_diff(runs)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
