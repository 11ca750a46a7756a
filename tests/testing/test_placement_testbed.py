"""``devices=[...]`` on a test bed with two measured devices: the measured process (device 0) and a
:class:`tflms.testing.device_worker.DeviceWorker` (device 1), each with its own BFC allocator and the
same real cap, each device's peak read from its own allocator. A step whose every measured peak on
one device is above the cap trains across the two under the same cap each, with the plain step's
losses.

One process cannot show this (two logical CPUs share one allocator: ``DESIGN.md`` §2b); numerics
and placement are checked there (``tests/integrations/test_placement.py``).
"""

import json
import subprocess
import sys

import pytest

from tflms import testbed

from conftest import TESTS

pytestmark = pytest.mark.integration

JOB = TESTS / "placement_testbed_job.py"
#: The zoo's CNN at 64 px, batch 32, Adam.
BATCH = 32
#: The cap, as a fraction of the lowest step peak of the plain step measured uncapped in the same
#: test (so the test follows the kernels and the machine, not one day's figure): below what the
#: plain step needed on one device in every step, with room for the placed step's spread between
#: processes. The plain step is not run under the cap: a process's peak varies with its threads'
#: interleaving (by up to 15 % on a loaded machine), so in another process a plain step may fit a
#: cap below every step peak of its reference.
CAP_FRACTION = 0.85


def _run(mode: str, cap_mib: int) -> tuple[dict | None, str]:
    env = testbed.device_environ(f"{cap_mib}MiB" if cap_mib else None)
    env["PYTHONPATH"] = ":".join(p for p in sys.path if p)
    r = subprocess.run(
        [sys.executable, str(JOB), mode, str(BATCH), str(cap_mib)], capture_output=True, text=True, timeout=900, env=env
    )
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    return (json.loads(lines[-1][len("RESULT ") :]) if lines and r.returncode == 0 else None), r.stderr[-2000:]


@pytest.mark.measured
@pytest.mark.slow
def test_a_step_out_of_memory_on_one_device_trains_placed_on_two_with_the_same_cap():
    reference, err = _run("plain", 0)
    assert reference is not None and reference["status"] == "ok", err
    lowest = min(p[0] for p in reference["peaks"])
    cap_mib = int(CAP_FRACTION * lowest) // 2**20
    placed, err = _run("placed", cap_mib)
    assert placed is not None and placed["status"] == "ok", err
    # The plain step's losses, bit for bit (the same kernels; the transfers copy).
    assert placed["losses"] == reference["losses"]
    cap = cap_mib * 2**20
    assert lowest > cap  # every plain step needed more than the cap on one device
    for device in (0, 1):
        measured = [p[device] for p in placed["peaks"]]
        assert 0 < max(measured) <= cap, (device, measured)
    # Both devices hold a real share: each at least a third of the plain step's peak.
    assert min(max(p[d] for p in placed["peaks"]) for d in (0, 1)) > lowest / 3
    assert max(placed["predicted"]) < placed["predicted_plain"]
