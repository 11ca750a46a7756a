"""``offload="optimizer"`` under a real memory cap, measured on the two-process test bed.

For a handful of depths of the zoo's GPT (``tflms.testing.zoo``, Adam): whether its training step
runs under one real cap (``TF_CPU_BFC_MEM_LIMIT_IN_MB`` in the measured process) plainly and with
``offload="optimizer"`` (the Adam state on the host worker, the update run there; a budget that
swaps nothing, so the offload alone), each in a fresh measured process of one warm-up step and
``--steps`` more (the job is ``tests/testbed_jobs.py:offload_gpt``). Per run: the measured
steady-state peak next to the simulator's prediction, the median step time, the losses; and, for
the deepest model the offload trains, the losses of an uncapped plain run to compare with.

Usage::

    python benchmarks/offload_capacity.py                      # cap 256 MiB, depths 4 8 12 16 24 32
    python benchmarks/offload_capacity.py --cap 320MiB --depths 8 16 32

Step times on the test bed are those of two processes sharing this machine's cores over gRPC, not
of a GPU and its host; the memory figures are read from the device process's allocator.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from report import save_result

from tflms.config import parse_bytes
from tflms.testbed import run_measured

TESTS = Path(__file__).resolve().parent.parent / "tests"
RESULT = Path(__file__).resolve().parent / "results" / "offload_capacity.json"


def _run(depth: int, offload: bool, cap: int | None, args: argparse.Namespace) -> dict:
    kwargs = {"layers": depth, "batch": args.batch, "seq": args.seq, "offload": offload, "steps": args.steps}
    r = run_measured("testbed_jobs:offload_gpt", kwargs, cap=cap, timeout=1200, pythonpath=[str(TESTS)])
    row = {"depth": depth, "offload": "optimizer" if offload else None, "cap_bytes": cap, "status": r.status}
    if r.ok:
        row.update(r.value)
    else:
        row["error"] = r.error.strip().splitlines()[-1][:300] if r.error else ""
    print(
        f"depth {depth:3d} {'offload' if offload else 'plain  '} cap {cap}: {r.status}"
        + (f", peak {r.value['peak'] / 2**20:.1f} MiB (predicted {r.value['predicted'] / 2**20:.1f})" if r.ok else ""),
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", default="256MiB")
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 8, 12, 16, 24, 32])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    cap = parse_bytes(args.cap, "cap")
    rows = [_run(depth, offload, cap, args) for depth in args.depths for offload in (False, True)]
    trained = {(r["depth"], r["offload"]) for r in rows if r["status"] == "ok"}
    plain = max((d for d, o in trained if o is None), default=None)
    offloaded = max((d for d, o in trained if o == "optimizer"), default=None)
    notes = []
    if offloaded is not None:
        reference = _run(offloaded, False, None, args)
        reference["reference"] = "uncapped plain run of the deepest model the offload trains"
        rows.append(reference)
        same = reference.get("losses") == next(
            r["losses"] for r in rows if r["depth"] == offloaded and r["offload"] == "optimizer" and r["status"] == "ok"
        )
        notes.append(f"losses of the offloaded depth {offloaded} equal the uncapped plain run's: {same}")
    notes.append(
        f"largest depth of those tried that trains under {args.cap}: plain {plain}, offload='optimizer' {offloaded}"
        " (a handful of depths, not a search)"
    )
    save_result(
        RESULT,
        "offload_capacity",
        rows,
        model="gpt (tflms.testing.zoo, vocab 8000, width 256), Adam",
        batch=args.batch,
        seq=args.seq,
        cap=args.cap,
        runs="each row a fresh measured process: 1 warm-up step + steps; peak = max over the steps after warm-up",
        largest_plain_depth=plain,
        largest_offload_depth=offloaded,
        notes=notes,
    )
    print("\n".join(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
