"""KerasHub GPT-2 through ``model.fit`` under a real memory cap, measured on the two-process test bed.

``GPT2CausalLM`` of ``tflms/testing/keras_hub.py`` (vocabulary 5000, 4 layers, 4 heads, hidden 256,
intermediate 1024; random weights, no preset), batch 8 of 128 tokens, Adam, 3 steps: the job
``tflms.testing.jobs:keras_hub_gpt2_fit``, which ``tests/ecosystem/test_keras_hub_testbed.py``
runs too, in a fresh measured process per way (plain, then ``LMSCallback`` given the test bed's
device and host and nothing else: ``budget="auto"``, 0.9 of the cap). Writes
``benchmarks/results/ecosystem_testbed.json``.

    python benchmarks/ecosystem_testbed.py                  # cap 220 MiB (about 2 minutes on 2 CPUs)
    python benchmarks/ecosystem_testbed.py --cap-mib 256
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from report import save_result

from tflms import testbed

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "ecosystem_testbed.json"
MiB = 2**20


def run(lms: bool, cap_mib: int) -> dict[str, Any]:
    """One way in a fresh measured process under the cap: a row of the JSON."""
    r = testbed.run_measured("tflms.testing.jobs:keras_hub_gpt2_fit", {"lms": lms}, cap=f"{cap_mib}MiB", timeout=1800)
    row: dict[str, Any] = {"way": "lms" if lms else "plain", "cap_mib": cap_mib, "status": r.status}
    if r.ok:
        v = r.value
        row.update(
            losses=v["losses"],
            peaks_mib=[round(p / MiB, 1) for p in v["peaks"]],
            steady_peak_mib=round(max(v["peaks"][1:]) / MiB, 1),
            loaded_mib=round(v["loaded"] / MiB, 1),
        )
        if lms:
            row.update(
                n_swaps=v["n_swaps"],
                swapped_mib=round(v["swapped_bytes"] / MiB, 1),
                swap_shapes=v["swap_shapes"],
                predicted_mib=round(v["predicted"] / MiB, 1),
                predicted_plain_mib=round(v["predicted_plain"] / MiB, 1),
                measured_over_predicted=round(max(v["peaks"][1:]) / v["predicted"], 3),
                budget_text=v["budget_text"],
                replans=v["replans"],
            )
    elif r.oom:
        row["oom"] = {k: r.oom.get(k) for k in ("op", "requested", "in_use", "largest_free")}
    else:
        row["error"] = r.error[-1500:]
    print(row, flush=True)
    return row


def _commit() -> str:
    import subprocess

    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-mib", type=int, default=220)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    rows = [run(False, args.cap_mib), run(True, args.cap_mib)]
    notes = [
        "KerasHub 0.32 GPT2CausalLM built from a config (vocabulary 5000, 4 layers, 4 heads, hidden 256, "
        "intermediate 1024, max sequence 128; preprocessor=None), random weights; batch 8 of 128 tokens, Adam "
        "1e-3, the padding mask as sample weight; op determinism on",
        "each way is one fresh measured process (tflms.testing.jobs:keras_hub_gpt2_fit): 3 steps of "
        "model.fit; peaks_mib per step (the allocator's peak reset as each step begins), steady_peak_mib the "
        "largest after the first step",
        "lms: LMSCallback(device=testbed.DEVICE, host=testbed.HOST), no other option (budget='auto': 0.9 x the "
        "cap, then planned once more where the first calls' measured peaks say so: replans; the default policy); "
        "KerasHub feeds fit batches of unknown size, the callback plans for batch 8; the lms row's plan is the one "
        "the last step ran",
        f"tflms commit {_commit()} (with whatever the working tree changed)",
        "the 2 CPU cores are shared with the host process and with whatever else ran on the machine",
    ]
    save_result(args.out, "ecosystem_testbed", rows, model="keras_hub.GPT2CausalLM", batch=8, notes=notes)
    return 0 if all(r["status"] in ("ok", "oom") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
