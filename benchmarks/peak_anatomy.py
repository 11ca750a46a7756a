"""What a measured peak holds on the test bed, next to what the simulator's peak holds.

Each case runs in a fresh measured process (:func:`tflms.testing.measure.anatomy_step`): a few
warm-up Adam steps, one unprofiled step (its peak), then one step under TensorFlow's
profiler, whose allocator events say which op allocated each chunk that was live when
the allocator's bytes in use peaked. Bytes are grouped by phase (forward, backward,
update, swap, other) and compared with the simulator's live buffers at its predicted
peak and at the op that reached the measured one. Two more figures split the error:
what the live chunks' ops requested (the measured peak without the allocator's
rounding and unsplit rests), and the simulator's peak when it runs the ops in the
order the profiled step started them (:func:`tflms.testing.measure.recorded_order`); and the
simulator's allocator emulation run on the profiled step's own allocations
(:func:`tflms.testing.measure.replay_allocations`), which isolates the allocator. The profiler slows the step, and on
the test bed a swapped tensor's device buffer lives until the link has sent it, so the
profiled peak can be higher than the unprofiled one: both are printed.

Usage::

    python benchmarks/peak_anatomy.py --cases resnet50:32:lms cnn:32:plain
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from report import PHASES, save_result
from report import _mib_number as _mib

from tflms.testbed import run_measured

DEFAULT_CASES = ("cnn:32:plain", "cnn:32:lms", "transformer:8:plain", "resnet50:32:plain", "resnet50:32:lms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="MODEL:BATCH:MODE (MODE plain or lms)")
    default_json = Path(__file__).resolve().parent / "results/peak_anatomy.json"
    parser.add_argument("--json", type=Path, default=default_json)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    rows = []
    head = f"{'case':22} {'unprofiled':>10} {'profiled':>9} {'requested':>9} {'at':>9} " + " ".join(
        f"{p:>8}" for p in PHASES
    )
    print(head + "   (MiB; 'at': the peak's phase; phases: live buffers, measured / predicted)")
    for case in args.cases:
        model, batch, mode = case.split(":")
        r = run_measured("tflms.testing.measure:anatomy_step", {"model": model, "batch": int(batch), "mode": mode})
        if not r.ok:
            print(f"{case:22} {r.status}: {r.error[-200:]}")
            rows.append({"case": case, "error": f"{r.status}: {r.error[-300:]}"})
            continue
        v = r.value
        rows.append(v)
        prof, pred = v["profiled"], v["predicted"]
        rec = v["recorded_order"]
        print(
            f"{case:22} {_mib(v['measured_peak']):>10} {_mib(prof['in_use']):>9} {_mib(prof['requested']):>9} "
            f"{prof['op_phase']:>9} " + " ".join(f"{_mib(prof['by_phase'].get(p, 0)):>8}" for p in PHASES)
        )
        print(
            f"{'  predicted':22} {'':>10} {_mib(pred['peak']):>9} {_mib(pred['requested']):>9} {pred['op_phase']:>9} "
            + " ".join(f"{_mib(pred['by_phase'].get(p, 0)):>8}" for p in PHASES)
        )
        print(
            f"{'  in recorded order':22} {'':>10} {_mib(rec['peak']):>9} {_mib(rec['requested']):>9}"
            f"   ({rec['ops_recorded']} of {rec['ops']} traced ops recorded)"
        )
        replayed = _mib(v["replayed"]["peak"])
        print(f"{'  allocator, replayed':22} {'':>10} {replayed:>9}   (the emulation on these allocations)")
    save_result(args.json, "peak_anatomy", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
