"""``offload="optimizer"`` and ``offload="weights"`` under a real memory cap, measured on the test bed.

For a handful of depths of the zoo's GPT (``tflms.testing.zoo``, Adam): whether its training step
runs under one real cap (``TF_CPU_BFC_MEM_LIMIT_IN_MB`` in the measured process) plainly, with
``offload="optimizer"`` (the Adam state on the host worker, the update run there; with
``--optimizer-budget none``, the default, every activation of ``--min-bytes`` or more is swapped as
well, without the memory-aware schedule and with at most ``--optimizer-window`` swap-outs in
flight; ``--optimizer-budget 64GiB`` swaps nothing: the offload alone) and with
``offload="weights"`` (the model made on the host worker too, each weight copied to the device for
its uses; with ``--weights-budget none``, the default, every activation of ``--min-bytes`` or more
is swapped as well, without the memory-aware schedule), each in a fresh measured process of one
warm-up step and ``--steps`` more (the job is ``tflms.testing.jobs:offload_gpt``). Per run: the
measured steady-state peak next to the simulator's prediction, the median step time, the losses;
and, for the deepest model each offload trains, the losses of an uncapped plain run to compare
with.

Usage::

    python benchmarks/offload_capacity.py                      # cap 256 MiB, depths 4 8 12 16 24 32
    python benchmarks/offload_capacity.py --cap 320MiB --depths 8 16 32
    python benchmarks/offload_capacity.py --offloads weights --depths 32 64 128 --keep   # add rows
    python benchmarks/offload_capacity.py --offloads optimizer --depths 16 32 48 53 --keep

Step times on the test bed are those of two processes sharing this machine's cores over gRPC, not
of a GPU and its host; the memory figures are read from the device process's allocator.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from report import save_result

from tflms.config import parse_bytes
from tflms.testbed import run_measured

RESULT = Path(__file__).resolve().parent / "results" / "offload_capacity.json"


def _run(depth: int, offload: str | None, cap: int | None, args: argparse.Namespace) -> dict:
    kwargs = {"layers": depth, "batch": args.batch, "seq": args.seq, "offload": offload or False, "steps": args.steps}
    if offload in ("optimizer", "weights"):
        given = args.weights_budget if offload == "weights" else args.optimizer_budget
        budget = None if given == "none" else given
        kwargs.update(budget=budget, min_bytes=args.min_bytes, serialize=False)
    if offload == "optimizer" and args.optimizer_window != "auto":
        kwargs["swapout_window"] = None if args.optimizer_window == "none" else int(args.optimizer_window)
    r = run_measured("tflms.testing.jobs:offload_gpt", kwargs, cap=cap, timeout=3000)
    row = {"depth": depth, "offload": offload, "cap_bytes": cap, "status": r.status}
    if offload == "weights":
        row["weights_budget"], row["min_bytes"] = args.weights_budget, args.min_bytes
    if offload == "optimizer":
        row["optimizer_budget"], row["min_bytes"] = args.optimizer_budget, args.min_bytes
        row["swapout_window"] = args.optimizer_window
    if r.ok:
        row.update(r.value)
    else:
        row["error"] = r.error.strip().splitlines()[-1][:300] if r.error else ""
    print(
        f"depth {depth:3d} {offload or 'plain':9s} cap {cap}: {r.status}"
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
    parser.add_argument("--offloads", nargs="+", default=["none", "optimizer", "weights"])
    parser.add_argument("--weights-budget", default="none", help="budget of the weights rows ('none': swap all)")
    parser.add_argument(
        "--optimizer-budget", default="none", help="budget of the optimizer rows ('none': swap all; '64GiB': none)"
    )
    parser.add_argument(
        "--optimizer-window",
        default="2",
        help="swapout_window of the optimizer rows: at most this many swap-outs in flight ('auto': tflms's default)",
    )
    parser.add_argument("--min-bytes", type=int, default=4096, help="min_bytes of the optimizer and weights rows")
    parser.add_argument("--keep", action="store_true", help="keep the saved rows of the (depth, offload) not run")
    parser.add_argument("--no-reference", action="store_true", help="no uncapped plain run of the deepest")
    args = parser.parse_args(argv)
    cap = parse_bytes(args.cap, "cap")
    modes = [None if o == "none" else o for o in args.offloads]
    rows = [_run(depth, offload, cap, args) for depth in args.depths for offload in modes]
    saved = json.loads(RESULT.read_text()) if args.keep and RESULT.exists() else {"rows": [], "notes": []}
    if args.keep:
        run = {(r["depth"], r["offload"]) for r in rows}
        rows = [r for r in saved["rows"] if (r["depth"], r["offload"]) not in run and not r.get("reference")] + rows
        rows += [r for r in saved["rows"] if r.get("reference") and r.get("reference_for") not in modes]
    trained = {(r["depth"], r["offload"]) for r in rows if r["status"] == "ok" and r.get("cap_bytes") is not None}
    deepest = {o: max((d for d, m in trained if m == o), default=None) for o in (None, "optimizer", "weights")}
    params = {r["depth"]: r["weight_bytes"] // 4 for r in rows if "weight_bytes" in r}
    notes = []
    if args.keep:  # what the kept references showed
        notes += [n for n in saved["notes"] if n.startswith("losses of") and not any(repr(m) in n for m in modes)]
    for offload in [m for m in modes if m is not None and deepest[m] is not None and not args.no_reference]:
        reference = _run(deepest[offload], None, None, args)
        reference["reference"] = f"uncapped plain run of the deepest model offload={offload!r} trains"
        reference["reference_for"] = offload
        rows.append(reference)
        same = reference.get("losses") == next(
            r["losses"]
            for r in rows
            if r["depth"] == deepest[offload] and r["offload"] == offload and r["status"] == "ok"
        )
        depth = deepest[offload]
        notes.append(f"losses of offload={offload!r} at depth {depth} equal the uncapped plain run's: {same}")
    for r in rows:
        if r.get("reference") and "reference_for" not in r:
            r["reference_for"] = "optimizer"
    base = params.get(deepest[None])
    for offload in ("optimizer", "weights"):
        if deepest[offload] is not None and base:
            factor = params[deepest[offload]] / base
            notes.append(
                f"offload={offload!r}: deepest trained {deepest[offload]} ({params[deepest[offload]] / 1e6:.1f} M "
                f"parameters), {factor:.1f}x the plain step's {deepest[None]} ({base / 1e6:.1f} M)"
            )
    notes.append(
        f"largest depth of those tried that trains under {args.cap}: plain {deepest[None]}, offload='optimizer' "
        f"{deepest['optimizer']}, offload='weights' {deepest['weights']} (a handful of depths, not a search)"
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
        largest_plain_depth=deepest[None],
        largest_offload_depth=deepest["optimizer"],
        largest_weights_depth=deepest["weights"],
        notes=notes,
    )
    print("\n".join(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
