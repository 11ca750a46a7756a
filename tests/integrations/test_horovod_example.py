"""The flow of Horovod's own example (``tensorflow2_synthetic_benchmark.py``) through tflms.

tests/horovod_jobs/synthetic_benchmark.py is a job written for these tests with the flow and the
flags of Horovod's example and the tflms calls of docs/horovod.md ("Horovod's own example"):
``tflms.function``, tflms's ``DistributedGradientTape`` and ``broadcast_variables`` (Horovod's
raise on Keras 3 variables), ``tflms.horovod.init(split_cpu=True)`` (no GPU here: ``/device:CPU:1``
plays it) and a seed per rank. Two ``horovodrun --gloo -np 2`` runs of it with the example's flags
(MobileNetV2, batch 2 per rank, 224x224: 1 + 1 + 2 steps, about 40 s each), one with
``tflms.function`` and one with plain ``tf.function`` (``--no-tflms``), each saving every rank's
final model and optimizer variables. Each rank trains on its own random
batch from its own random initial weights (seed = rank), so the ranks end with the same
trainable weights only if the first step's broadcast and every step's allreduce work.

Like tests/integrations/test_horovod.py, these skip only when Horovod is not installed *and*
the environment variable ``CI`` is unset.
"""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
from test_horovod import JOBS, horovod_available, horovodrun  # noqa: F401 - horovod_available is a fixture

pytestmark = pytest.mark.distributed

SCRIPT = JOBS / "synthetic_benchmark.py"
MODEL = "MobileNetV2"
# The example's own flags, small: 224x224 images are the example's (no flag changes them).
FLAGS = (
    "--model", MODEL, "--batch-size", "2", "--num-warmup-batches", "1",
    "--num-batches-per-iter", "2", "--num-iters", "1", "--no-cuda",
)  # fmt: skip
TIMEOUT_S = 300
PLAN_LINE = re.compile(r"\[0\]<stdout>:tflms plan for benchmark_step: (\d+) tensors swapped \(([^)]*)\)")


def _load(path) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def _run(tmp_path_factory, way: str) -> tuple[str, list[list[np.ndarray]]]:
    """One 2-rank run of the example: (horovodrun's output, each rank's final variables)."""
    out = tmp_path_factory.mktemp(f"synthetic_{way}")
    extra = ("--no-tflms",) if way == "plain" else ()
    run = horovodrun(SCRIPT, *FLAGS, *extra, "--save-weights", str(out / "rank{rank}.npz"), timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-6000:]
    assert "[0]<stdout>:Total img/sec on 2 CPU(s):" in run.stdout, run.stdout[-6000:]
    return run.stdout, [_load(out / f"rank{r}.npz") for r in range(2)]


@pytest.fixture(scope="module")
def tflms_run(horovod_available, tmp_path_factory):  # noqa: F811 - the fixture imported above
    return _run(tmp_path_factory, "tflms")


@pytest.fixture(scope="module")
def plain_run(horovod_available, tmp_path_factory):  # noqa: F811 - the fixture imported above
    return _run(tmp_path_factory, "plain")


@pytest.fixture(scope="module")
def layout():
    """Which saved arrays are BatchNorm moving statistics, and rank 0's and rank 1's initial weights.

    The script saves ``model.variables + opt.variables``; a model built here with the script's
    seeds has the same variables in the same order and the ranks' initial values.
    """
    initial = []
    for rank in range(2):
        keras.utils.set_random_seed(rank)
        model = getattr(keras.applications, MODEL)(weights=None)
        initial.append([v.numpy() for v in model.variables])
    per_rank = [not v.trainable for v in model.variables]
    return per_rank, initial


@pytest.fixture(params=["tflms", "plain"])
def run(request):
    return request.param, request.getfixturevalue(f"{request.param}_run")


def test_tflms_plans_swap(tflms_run):
    """Both traces (``first_batch`` True and False) are planned with swaps at the default ``min_bytes``."""
    output, _ = tflms_run
    plans = PLAN_LINE.findall(output)
    assert len(plans) == 2, output[-6000:]
    assert all(int(n) > 10 for n, _ in plans), plans


def test_ranks_end_with_the_same_weights(run, layout):
    """Bit for bit, but for BatchNorm's moving statistics, which stay per rank (each rank's own batch)."""
    way, (_, ranks) = run
    per_rank, initial = layout
    rank0, rank1 = ranks
    assert len(rank0) == len(rank1) == len(per_rank) + 2  # + the optimizer's iterations and learning rate
    per_rank = per_rank + [False, False]
    for i, (a, b) in enumerate(zip(rank0, rank1)):
        if per_rank[i]:  # the statistics of different batches: the ranks did train on different data
            assert not np.array_equal(a, b), f"{way}: variable {i}"
        else:
            np.testing.assert_array_equal(a, b, err_msg=f"{way}: variable {i}")
    assert int(rank0[-2]) == 4  # 1 + 1 warm-up steps and 1 x 2 benchmark steps
    # Trained from rank 0's initial weights (the broadcast), not rank 1's, and moved.
    trained = [(got, r0, r1) for got, r0, r1, p in zip(rank0, *initial, per_rank) if not p]
    moved = np.sqrt(sum(np.sum((got - r0).astype("float64") ** 2) for got, r0, _ in trained))
    from_rank1 = np.sqrt(sum(np.sum((got - r1).astype("float64") ** 2) for got, _, r1 in trained))
    assert 0 < moved < from_rank1 / 10, (moved, from_rank1)


def test_tflms_trains_bit_for_bit_like_tf_function(tflms_run, plain_run):
    """Every rank's every variable, BatchNorm statistics included, as with plain ``tf.function``."""
    for rank, (lms, plain) in enumerate(zip(tflms_run[1], plain_run[1])):
        assert len(lms) == len(plain)
        for i, (a, b) in enumerate(zip(lms, plain)):
            np.testing.assert_array_equal(a, b, err_msg=f"rank {rank}: variable {i}")
