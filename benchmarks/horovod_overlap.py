"""When the gradient exchange starts, with ``offload="optimizer"`` and Horovod: one profiled step.

Run with::

    horovodrun --gloo -np 2 -H localhost:2 python benchmarks/horovod_overlap.py [--layers 8] [--json PATH]

(the venv's ``bin`` must be on PATH). Each rank trains the zoo's GPT (width 256, batch 2,
sequence 64, Adam) through ``tflms.function(..., offload="optimizer")`` with
:class:`tflms.integrations.horovod.DistributedGradientTape` (groups of at most ``--group-mib``):
the optimizer's state and update on the host, each gradient group's allreduce there too. After
``--warmup`` steps, one step runs under TensorFlow's profiler on every rank; from the executor's
records (the start and end of each op's kernel on this CPU machine; an allreduce's record is the
call that hands its group to Horovod's background thread) rank 0 reports, per rank, the span of
the backward pass (ops under ``gradient_tape/``), when each allreduce group was handed over and
when the update's ops (under the optimizer's name scope) ran, each relative to the backward
pass's start, and the share of the backward pass still to run when the first group was handed
over. Writes ``benchmarks/results/horovod_overlap.json`` (``--json``).

The CPU is split into two logical devices before TensorFlow initialises them: ``/device:CPU:1``
plays the GPU and ``/device:CPU:0`` the host. Both ranks share the machine's cores, so the times
say in which order the exchange and the backward pass ran, not how fast a network would be.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEVICE, HOST = "/device:CPU:1", "/device:CPU:0"
RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "horovod_overlap.json")


def spans(kernels: list[dict], prefix: str) -> list[tuple[float, float, str]]:
    """``(start ms, end ms, op)`` of the executor records whose op name starts with ``prefix`` or
    contains ``/prefix``."""
    return [
        (k["time_ns"] / 1e6, (k["time_ns"] + k["duration_ns"]) / 1e6, k["op"])
        for k in kernels
        if k["source"] == "executor" and (k["op"].startswith(prefix) or f"/{prefix}" in k["op"])
    ]


def summary(kernels: list[dict], graph: Any) -> dict:
    """The step's backward span and, per allreduce group of ``graph`` (the rewritten step's), when
    its gradients were ready (the last of their producers ended) and when its averaged gradients
    were first read (the first op downstream of the allreduce started: the exchange had ended by
    then), in ms from the backward pass's first op. TensorFlow's profiler records no kernel for
    Horovod's asynchronous allreduce op itself, hence the two ends."""
    start = {k["op"]: k["time_ns"] / 1e6 for k in kernels if k["source"] == "executor"}
    end = {k["op"]: (k["time_ns"] + k["duration_ns"]) / 1e6 for k in kernels if k["source"] == "executor"}
    backward = [op for op in start if op.startswith("gradient_tape/")]
    t0, t1 = min(start[op] for op in backward), max(end[op] for op in backward)
    groups = []
    for op in graph.get_operations():
        if not op.type.startswith("Horovod"):
            continue
        ready = [end[t.op.name] for t in op.inputs if t.op.name in end]
        seen, stack, first = set(), list(op.outputs), []
        while stack:  # the first ops that ran on each path downstream of the allreduce
            tensor = stack.pop()
            for c in tensor.consumers():
                if c.type == "IdentityN":  # output k of an IdentityN is its input k: follow that one only
                    k = next(i for i, t in enumerate(c.inputs) if t is tensor)
                    nxt = [c.outputs[k]]
                elif c.name in start:
                    first.append((start[c.name], c.name))
                    continue
                else:  # not run under its name (its consumers read the averaged gradient)
                    nxt = list(c.outputs)
                stack.extend(t for t in nxt if t.name not in seen and not seen.add(t.name))
        groups.append(
            {
                "op": op.name,
                "gradients": len(op.inputs),
                "ready_ms": round(max(ready) - t0, 2) if ready else None,
                "averaged_read_ms": round(min(first)[0] - t0, 2) if first else None,
                "averaged_read_by": min(first)[1] if first else None,
            }
        )
    groups.sort(key=lambda g: (g["ready_ms"] is None, g["ready_ms"]))
    backward_ms = t1 - t0
    read = [g["averaged_read_ms"] for g in groups if g["averaged_read_ms"] is not None]
    return {
        "backward_ms": round(backward_ms, 2),
        "groups": groups,
        "groups_done_before_backward_end": sum(r < backward_ms for r in read),
        "backward_left_at_first_averaged_read": round(max(0.0, backward_ms - min(read)) / backward_ms, 3)
        if read
        else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8, help="GPT blocks")
    p.add_argument("--group-mib", type=float, default=8.0, help="allreduce groups of at most this many MiB")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=RESULT)
    args = p.parse_args(argv)

    import tflms.integrations.horovod as lms_hvd

    lms_hvd.init(split_cpu=True)
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import tflms
    from tflms import _tf_internal as tfi
    from tflms.testing.zoo import build, train_step_of

    # Each rank its own data; rank 0's weights broadcast below.
    model, x, y, zoo_step = build("gpt", 2, 64, seed=hvd.rank(), layers=args.layers, offload_host=HOST)
    optimizer = zoo_step.optimizer
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    group_bytes = int(args.group_mib * 2**20)

    train_step = train_step_of(
        model, loss_fn, optimizer, lambda tape: lms_hvd.DistributedGradientTape(tape, group_bytes=group_bytes)
    )
    step = tflms.function(train_step, device=DEVICE, host=HOST, offload="optimizer", budget="64GiB")
    lms_hvd.broadcast_variables(model.variables, root_rank=0)
    with tf.device(DEVICE):
        for _ in range(args.warmup):
            step(x, y)
        kernels = tfi.profile_kernels(lambda: step(x, y))
    mine = summary(kernels, step.get_concrete_function(x, y).graph)
    every = hvd.allgather_object(mine)
    if hvd.rank() == 0:
        result = {
            "benchmark": "horovod_overlap",
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "tensorflow": tf.__version__,
            "tflms": tflms.__version__,
            "model": f"gpt, {args.layers} blocks, width 256, batch 2 per rank, sequence 64, Adam",
            "ranks": hvd.size(),
            "group_mib": args.group_mib,
            "rows": [{"rank": r, **row} for r, row in enumerate(every)],
            "notes": [
                "one profiled step per rank after the warm-up; times in ms from the rank's first backward op; "
                "'ready': the last gradient of the group produced; 'averaged read': the first op that read the "
                "group's averaged gradients started (the exchange had ended by then; the profiler records no "
                "kernel for Horovod's asynchronous allreduce itself)",
                "both ranks, their Horovod threads and the host updates share the machine's 2 CPU cores: the "
                "order of events is measured, the durations are not a network's",
            ],
        }
        print(json.dumps(result, indent=1))
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
