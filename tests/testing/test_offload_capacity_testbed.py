"""``offload="optimizer"`` with the activations swapped too, on the real-memory test bed: three times
the parameters that the plain step trains under a cap.

With the optimizer offloaded alone (a budget that swaps nothing), the device holds the weights and
every activation the backward pass reads: measured on the zoo's GPT, the peak is at the end of the
forward pass and the activations fill it (``benchmarks/results/offload_capacity.json``: under
256 MiB the offload alone trains 32 blocks, with the activations swapped 64 and more). Swapping
every activation as well leaves the weights and a few layers' tensors; at most two swap-outs in
flight (``swapout_window=2``) keep the forward pass from running ahead of the link, whose
swapped-out buffers wait on the device until sent.
"""

import keras
import pytest

from tflms import testbed
from tflms.testing.zoo import build

from conftest import TESTS

pytestmark = pytest.mark.integration

CAP = "160MiB"
#: The GPT of tflms.testing.zoo at batch 2, sequence 64: its plain Adam step at 8 blocks needs more
#: than the cap (179-181 MiB measured, ``tests/testing/test_offload_testbed.py``).
PLAIN = {"layers": 8, "batch": 2, "seq": 64, "steps": 3}
#: 36 blocks: 32.5 M parameters, 3.1 times the 8 blocks' 10.4 M.
DEEP = {**PLAIN, "layers": 36}
#: Every activation of 4 kB or more swapped, at most 2 swap-outs in flight.
SWAPPED = {"budget": None, "min_bytes": 4096, "serialize": False, "swapout_window": 2}
#: A measured peak is at least this share of the simulator's requested-bytes peak on any CPU: the
#: allocator's rounding and rests, which the prediction emulates, appear or not with the order the
#: CPU's threads allocate in (tests/testing/test_testbed.py, ``BELOW_REQUESTED``).
BELOW_REQUESTED = 0.9


def _parameters(layers: int) -> int:
    model = build("gpt", 2, 64, layers=layers)[0]
    count = sum(int(v.numpy().size) for v in model.trainable_variables)
    keras.backend.clear_session()
    return count


@pytest.mark.measured
def test_gpt_with_three_times_the_plain_parameters_trains_with_the_optimizer_offloaded_and_swaps():
    jobs = [str(TESTS)]

    def run(kwargs, cap=CAP):
        return testbed.run_measured("testbed_jobs:offload_gpt", kwargs, cap=cap, timeout=1200, pythonpath=jobs)

    assert _parameters(DEEP["layers"]) >= 3 * _parameters(PLAIN["layers"])
    plain = run(PLAIN)
    assert plain.status == "oom", (plain.status, plain.value, plain.error[-2000:])
    off = run({**DEEP, "offload": "optimizer", **SWAPPED})
    assert off.ok, off.error[-3000:]
    reference = run(DEEP, cap=None)
    assert reference.ok, reference.error[-3000:]
    o, r = off.value, reference.value
    # The same losses as the plain step without a cap, bit for bit.
    assert o["losses"] == r["losses"] and o["losses"][-1] < o["losses"][0]
    # The weights are most of what stays: 124 MiB of the cap's 160.
    assert o["peak"] < 160 * 2**20 and o["weight_bytes"] > 0.75 * o["peak"], o["peaks"]
    # Measured against predicted: the simulator sends a swap-out at once, which the window makes
    # nearly true (0.97-1.09 from 8 to 64 blocks under 256 MiB when this was written; without the
    # window 0.96-1.48 from 8 to 32 blocks: benchmarks/offload_capacity.py). Requested: 0.98 of predicted.
    low, high = BELOW_REQUESTED * o["requested"], 1.15 * o["predicted"]
    assert low <= o["peak"] <= high, (o["peaks"], o["requested"], o["predicted"])
