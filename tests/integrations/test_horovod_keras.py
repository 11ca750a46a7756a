"""``model.fit`` under ``horovodrun`` with ``tflms.integrations.horovod.HorovodLMSCallback``.

One real ``horovodrun --gloo -np 2`` job (tests/horovod_jobs/fit_job.py, about 20 s)
trains several models with ``fit``, each rank on its own shard; the tests compare
what the ranks wrote with each other and with single-process Keras training on the
concatenated batches, computed here. A negative control in the same job (the plain
callback, no averaging) shows that the comparisons can fail. The tests without
``horovodrun`` pin the single-rank behaviour: with Horovod not initialised,
``HorovodLMSCallback`` (and ``tflms.LMSCallback(horovod=True)``, which makes one)
trains bit for bit like Keras's own ``fit``.

Like tests/test_horovod.py, the job tests skip only when Horovod is not installed
*and* the environment variable ``CI`` is unset.
"""

from __future__ import annotations

import json
import re
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_horovod import JOBS, horovod_available, horovodrun  # noqa: F401 - horovod_available is a fixture

import tflms
import tflms.integrations.horovod as lms_hvd
import tflms.integrations.keras
from tflms import LMSWarning

import zoo
from conftest import DEVICE, HOST, SMALL

if str(JOBS) not in sys.path:  # test_horovod put it there already
    sys.path.insert(0, str(JOBS))
import fit_job
import jobkit

pytestmark = pytest.mark.distributed

B = jobkit.PER_RANK_BATCH
RTOL, ATOL = 1e-5, 1e-6


def _load(path) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(u.astype("float64") - v))) for u, v in zip(a, b) if u.dtype.kind == "f")


def _assert_close_logs(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=ATOL, err_msg=key)


@pytest.fixture(scope="module")
def job(horovod_available, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """One 2-rank run of horovod_jobs/fit_job.py: (out dir, both rank reports, output by rank and stream)."""
    out = tmp_path_factory.mktemp("horovod_fit")
    run = horovodrun(JOBS / "fit_job.py", "--out", str(out))
    assert run.returncode == 0, run.stdout[-6000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    # horovodrun prefixes every chunk a rank writes with "[rank]<stream>:".
    streams: dict[tuple[int, str], str] = {}
    parts = re.split(r"\[(\d+)\]<(stdout|stderr)>:", run.stdout)
    for rank, stream, text in zip(parts[1::3], parts[2::3], parts[3::3]):
        streams[int(rank), stream] = streams.get((int(rank), stream), "") + text
    return out, reports, streams


@pytest.fixture(scope="module")
def reference(job):
    """One process, Keras's own fit (no Horovod, no LMS), global batches of 2 B, from rank 0's initial state."""
    out, _, _ = job
    initial = _load(out / "initial.npz")
    x, y = fit_job.train_data(2)
    val = fit_job.val_data(2)

    def fit(data, batch_size, validation_data=None):
        model = fit_job.compile_model(jobkit.build_cnn(0))
        model.optimizer.build(model.trainable_variables)
        for v, value in zip(fit_job.state(model), initial, strict=True):
            v.assign(value)
        rec = fit_job.Recorder.make()
        kwargs = {"shuffle": False, "verbose": 0, "callbacks": [rec]}
        with tf.device(DEVICE):
            first = model.fit(
                *data, batch_size=batch_size, epochs=fit_job.EPOCHS, validation_data=validation_data, **kwargs
            )
            second = model.fit(*data, batch_size=batch_size, epochs=1, **kwargs)
        return {
            "history": first.history,
            "history_second_fit": second.history,
            "batch_logs": rec.batch_logs,
            "state": [v.numpy() for v in fit_job.state(model)],
        }

    together = fit((x, y), 2 * B, validation_data=val)
    rank0_alone = fit(fit_job.shard((x, y), 0, 2), B)
    return initial, together, rank0_alone


# -- the main case: CNN, 2 epochs + a second fit, validation ---------------------------


def test_ranks_end_identical_and_match_single_process(job, reference):
    out, _, _ = job
    initial, together, rank0_alone = reference
    rank0, rank1 = _load(out / "horovod_rank0.npz"), _load(out / "horovod_rank1.npz")
    assert len(rank0) == len(rank1) == len(together["state"]) == len(initial)
    for a, b in zip(rank0, rank1):
        np.testing.assert_array_equal(a, b)  # the same averaged update on both ranks, bit for bit
    for got, want in zip(rank0, together["state"]):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    # The comparison can fail: training moved the weights far beyond the tolerance,
    # and rank 0's half of the data alone leads elsewhere.
    assert _max_diff(rank0, initial) > 1e-2
    assert _max_diff(rank0, rank0_alone["state"]) > 1e-3


def _assert_ranks_match_the_one_device_run(out, name: str, together: dict) -> None:
    """The ranks of the run ``name`` (``<name>_rank<k>.npz``) end identical, equal bit for bit to
    the one-device Horovod run's rank 0, and within the tolerance to the single process's state."""
    rank0, rank1 = _load(out / f"{name}_rank0.npz"), _load(out / f"{name}_rank1.npz")
    on_one = _load(out / "horovod_rank0.npz")
    assert len(rank0) == len(rank1) == len(together["state"]) == len(on_one)
    for a, b, c in zip(rank0, rank1, on_one):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    for got, want in zip(rank0, together["state"]):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_offloaded_optimizer_averages_on_the_host_and_ranks_match_single_process(job, reference):
    """``offload="optimizer"`` under Horovod: the allreduce and the update run on the host, every rank ends
    with the same state, the single process's on the concatenated batch, and the device-side run's bits."""
    out, reports, _ = job
    _, together, _ = reference
    _assert_ranks_match_the_one_device_run(out, "offload", together)  # the host runs the same CPU kernels
    for a, b in zip(_load(out / "offload_initial.npz"), _load(out / "initial.npz")):
        np.testing.assert_array_equal(a, b)
    for r in reports:
        structure = r["offload"]["structure"]
        assert structure["horovod_ops"] and structure["horovod_devices"] == [HOST]
        assert {d.rsplit("/", 1)[-1] for d in structure["optimizer_state_devices"]} == {HOST.rsplit("/", 1)[-1]}
        assert r["offload"]["history"] == r["horovod"]["history"]
        assert r["offload"]["broadcasts"] == r["horovod"]["broadcasts"]  # once, the host's state included


def test_placed_fit_on_every_rank_matches_single_process(job, reference):
    """``devices=`` under Horovod: each rank places its step on its own two devices; the ranks end
    identical, equal to the single process and, bit for bit, to the one-device Horovod run."""
    out, reports, _ = job
    _, together, _ = reference
    _assert_ranks_match_the_one_device_run(out, "placed", together)
    for r in reports:
        devices = r["placed"]["structure"]["op_devices"]
        assert set(jobkit.PLACED) <= set(devices) and jobkit.HOST not in devices
        assert r["placed"]["history"] == r["horovod"]["history"]


def test_history_and_batch_logs_are_averaged(job, reference):
    _, (r0, r1), _ = job
    _, together, _ = reference
    h0, h1 = r0["horovod"], r1["horovod"]
    assert h0["history"] == h1["history"] and h0["history_second_fit"] == h1["history_second_fit"]
    assert h0["batch_logs"] == h1["batch_logs"]
    assert set(h0["history"]) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    # Means over the ranks of per-rank means over equal shards: the single-process values.
    _assert_close_logs(h0["history"], together["history"])
    _assert_close_logs(h0["history_second_fit"], together["history_second_fit"])
    assert len(h0["batch_logs"]) == (fit_job.EPOCHS + 1) * fit_job.STEPS
    for got, want in zip(h0["batch_logs"], together["batch_logs"], strict=True):
        _assert_close_logs(got, want)


def test_only_rank_0_prints(job):
    _, _, streams = job
    root, other = streams.get((0, "stdout"), ""), streams.get((1, "stdout"), "")
    assert "Epoch 1/2" in root and "Epoch 2/2" in root and "/step" in root and "val_loss" in root
    assert root.count("tflms plan for") == 1  # verbose=True in the first fit only
    for marker in ("Epoch", "/step", "━", "loss", "tflms plan"):
        assert marker not in other, f"rank 1 printed {marker!r}: {other[:2000]!r}"


def test_plan_is_identical_on_every_rank_and_swaps(job):
    _, reports, _ = job
    plans = [r["horovod"]["plan"] for r in reports]
    for plan in plans + [r["horovod"]["plan_second_fit"] for r in reports]:
        assert plan["fingerprint"] == plan["plan_fingerprint"] == plans[0]["fingerprint"]  # checked across ranks
        assert plan["n_swaps"] >= 1 and plan["device"] == DEVICE and plan["n_plans"] == 1
    for report in reports:
        s = report["horovod"]["structure"]
        assert s["n_swap_out"] == plans[0]["n_swaps"] and s["n_swap_in"] >= s["n_swap_out"]
        # Swap-ins are gated on the host (the copy to the device waits for the trigger).
        assert s["swap_in_devices"] == [HOST] and s["swap_out_devices"] == [HOST]
        # The gradients are averaged inside the rewritten graph (8 MiB groups: one for this CNN) ...
        assert s["horovod_ops"] == ["HorovodGroupedAllreduce"]
        # ... and tflms neither swapped a Horovod op's output nor triggered a swap-in on one.
        assert not [t for t in s["swap_out_input_types"] + s["swap_in_trigger_types"] if t.startswith("Horovod")]


def test_initial_state_is_broadcast_once(job):
    out, (r0, r1), _ = job
    h0, h1 = r0["horovod"], r1["horovod"]
    # Rank 1 built its model from another seed; fit started both from rank 0's model ...
    before, after = h0["model_digests"], h1["model_digests"]
    assert before["before_broadcast"] != after["before_broadcast"]
    assert before["after_broadcast"] == after["after_broadcast"] == before["before_broadcast"]
    # ... and from the same optimizer state, which the callback built first (fit does not, before the first step).
    assert not h0["optimizer_built_before_broadcast"]
    assert h0["begin_digests"][0] == h1["begin_digests"][0] == jobkit.digest(_load(out / "initial.npz"))
    # One broadcast of every model and optimizer variable; none at the second fit (a new callback).
    assert h0["broadcasts"] == h1["broadcasts"] == [h0["n_state"]]
    assert h0["begin_digests"][1] == h1["begin_digests"][1] != h0["begin_digests"][0]


# -- the negative control: the same job with the plain callback ------------------------


def test_negative_control_without_horovod_the_ranks_diverge(job, reference):
    out, (r0, r1), _ = job
    initial, together, _ = reference
    # Same initial state on both ranks (same seed, no broadcast) as the main case's ...
    assert r0["plain"]["begin_digest"] == r1["plain"]["begin_digest"] == jobkit.digest(initial)
    assert r0["plain"]["broadcasts"] == [] and r0["plain"]["n_swaps"] >= 1
    rank0, rank1 = _load(out / "plain_rank0.npz"), _load(out / "plain_rank1.npz")
    # ... yet every rank trains on its own gradients: the checks above fail.
    assert _max_diff(rank0, rank1) > 1e-3
    assert _max_diff(rank0, together["state"][: len(rank0)]) > 1e-3
    assert r0["plain"]["history"] != r1["plain"]["history"]


# -- other models ----------------------------------------------------------------------


def test_batchnorm_trainable_weights_are_identical_moving_statistics_are_per_rank(job):
    out, (r0, r1), _ = job
    for a, b in zip(_load(out / "bn_trainable_rank0.npz"), _load(out / "bn_trainable_rank1.npz"), strict=True):
        np.testing.assert_array_equal(a, b)
    assert r0["bn"]["non_trainable"] == r1["bn"]["non_trainable"] and len(r0["bn"]["non_trainable"]) == 2
    # Rank 1 had set its own moving statistics; the broadcast replaced them with rank 0's ...
    assert r0["bn"]["moving_at_begin_digest"] == r1["bn"]["moving_at_begin_digest"]
    assert r0["bn"]["all_at_begin_digest"] == r1["bn"]["all_at_begin_digest"]
    assert r0["bn"]["broadcasts"] == [20]
    # ... but each rank updates them from its own batches (plain data parallelism: documented).
    moving0, moving1 = _load(out / "bn_moving_rank0.npz"), _load(out / "bn_moving_rank1.npz")
    assert _max_diff(moving0, moving1) > 1e-4
    assert r0["bn"]["history"] == r1["bn"]["history"]  # steps_per_execution=2
    assert r0["bn"]["plan"]["fingerprint"] == r1["bn"]["plan"]["fingerprint"]
    assert r0["bn"]["plan"]["n_swaps"] >= 1


def test_unbuilt_subclassed_model_is_broadcast_at_its_first_step(job):
    out, (r0, r1), _ = job
    rank0, rank1 = _load(out / "subclassed_rank0.npz"), _load(out / "subclassed_rank1.npz")
    for a, b in zip(rank0, rank1, strict=True):
        np.testing.assert_array_equal(a, b)
    assert r0["subclassed"]["broadcasts"] == [r0["subclassed"]["n_state"]] == [14]
    assert r0["subclassed"]["history"] == r1["subclassed"]["history"]
    assert r0["subclassed"]["plan"]["n_swaps"] >= 1


def test_run_eagerly_still_averages(job):
    out, (r0, r1), _ = job
    for a, b in zip(_load(out / "eager_rank0.npz"), _load(out / "eager_rank1.npz"), strict=True):
        np.testing.assert_array_equal(a, b)
    assert r0["eager"]["history"] == r1["eager"]["history"]
    assert r0["eager"]["step"] is None  # no LMS step
    assert any("run_eagerly=True" in w and "still averaged" in w for w in r0["eager"]["warnings"])


def test_own_train_step_given_as_hook(job):
    out, (r0, r1), _ = job
    averaged = [_load(out / f"own_step_averaged_rank{r}.npz") for r in range(2)]
    for a, b in zip(*averaged, strict=True):
        np.testing.assert_array_equal(a, b)
    assert r0["own_step"]["averaged"]["warnings"] == [] and r0["own_step"]["averaged"]["n_swaps"] >= 1
    # A step that forgets the allreduce: a warning on every rank, and the ranks drift apart.
    unaveraged = [_load(out / f"own_step_unaveraged_rank{r}.npz") for r in range(2)]
    assert _max_diff(*unaveraged) > 1e-3
    for report in (r0, r1):
        assert any("holds no Horovod allreduce" in w for w in report["own_step"]["unaveraged"]["warnings"])
    assert r0["own_step"]["broadcasts"] == [14, 14]  # two models


# -- one process, Horovod not initialised: a single rank --------------------------------


@pytest.fixture
def one_process(monkeypatch):
    if lms_hvd.is_initialized():
        pytest.skip("Horovod is initialised in this process")
    monkeypatch.delenv("HOROVOD_RANK", raising=False)


def _fit(setup, callbacks=(), epochs=2, verbose=0, reset=True, **kwargs):
    """Fit on 2 batches, from the setup's initial state: (history, variables as numpy)."""
    if reset:
        setup.reset()
    x, y = setup.x.numpy(), setup.y.numpy()
    x, y = np.concatenate([x, np.roll(x, 1, axis=0)]), np.concatenate([y, np.roll(y, 1, axis=0)])
    with tf.device(DEVICE):
        history = setup.model.fit(
            x,
            y,
            batch_size=setup.x.shape[0],
            epochs=epochs,
            verbose=verbose,
            shuffle=False,
            callbacks=list(callbacks),
            **kwargs,
        )
    return history.history, [v.numpy() for v in setup.state()]


def _assert_same(a, b):
    assert a[0] == b[0]
    for u, v in zip(a[1], b[1], strict=True):
        np.testing.assert_array_equal(u, v)


def _compile(setup, **kwargs):
    setup.model.compile(optimizer=setup.optimizer, loss=setup.loss, jit_compile=False, **kwargs)
    return setup


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_one_process_horovod_true_trains_like_keras_fit(one_process, name):
    """Pins averaging_train_step to Keras's train_step (metrics, sample/class weights, validation)."""
    metrics = {"weighted_metrics": ["accuracy"], "metrics": ["accuracy"]}
    setup = _compile(zoo.ZOO[name](), **metrics)
    x, y = setup.x.numpy(), setup.y.numpy()
    kwargs = {
        "mlp": {
            "validation_data": (x[::-1].copy(), y[::-1].copy()),
            "class_weight": {k: 1 + 0.1 * k for k in range(10)},
        },
        "cnn": {"sample_weight": np.linspace(0.5, 1.5, 2 * len(y)).astype("float32")},
    }[name]
    plain = _fit(setup, **kwargs)
    plain_again = _fit(setup, epochs=1, reset=False, **kwargs)
    cb = lms_hvd.HorovodLMSCallback(device=DEVICE, **SMALL)
    assert cb.horovod and not cb.async_safe
    _assert_same(_fit(setup, [cb], **kwargs), plain)
    _assert_same(_fit(setup, [cb], epochs=1, reset=False, **kwargs), plain_again)  # a second fit continues
    assert len(cb.plan.swaps) >= 1 and cb.plans == [cb.plan] and cb.fingerprint == cb.plan.fingerprint()
    # Compiled with run_eagerly=True: no LMS, the same training.
    _compile(setup, run_eagerly=True, **metrics)
    plain = _fit(setup, epochs=1, **kwargs)
    with pytest.warns(LMSWarning, match="still averaged"):
        _assert_same(_fit(setup, [lms_hvd.HorovodLMSCallback(device=DEVICE, **SMALL)], epochs=1, **kwargs), plain)


def test_one_process_lmscallback_horovod_true_is_the_horovod_callback(one_process):
    """``tflms.LMSCallback(horovod=True)`` (the older spelling) makes a HorovodLMSCallback: same training."""
    setup = _compile(zoo.mlp())
    plain = _fit(setup)
    cb = tflms.LMSCallback(device=DEVICE, **SMALL, horovod=True)
    assert type(cb) is tflms.LMSCallback and cb.horovod  # the same callback, in its Horovod mode
    assert (
        tflms.integrations.keras.averaging_train_step is lms_hvd.averaging_train_step
    )  # still importable from tflms.integrations.keras
    _assert_same(_fit(setup, [cb]), plain)
    assert len(cb.plan.swaps) >= 1 and cb.fingerprint == cb.plan.fingerprint()
    # The plain callback trains the same numbers, without the Horovod parts.
    plain_cb = tflms.LMSCallback(device=DEVICE, **SMALL, horovod=False)
    assert type(plain_cb) is tflms.LMSCallback and cb.async_safe is False and plain_cb.async_safe is True
    _assert_same(_fit(setup, [plain_cb]), plain)
    assert plain_cb.fingerprint is None and plain_cb.plan.fingerprint() == cb.plan.fingerprint()

    # A subclass of tflms.LMSCallback asked for horovod=True: its overrides run, in the Horovod mode.
    class Counting(tflms.LMSCallback):
        made = 0

        def make_train_step(self, model):
            Counting.made += 1
            return super().make_train_step(model)

    sub = Counting(device=DEVICE, **SMALL, horovod=True)
    assert type(sub) is Counting and sub.horovod and sub.async_safe is False
    _assert_same(_fit(setup, [sub]), plain)
    assert Counting.made == 1 and sub.fingerprint == cb.fingerprint
    hvd_cb = lms_hvd.HorovodLMSCallback(device=DEVICE, **SMALL)
    assert isinstance(hvd_cb, tflms.LMSCallback) and hvd_cb.horovod and hvd_cb.sparse_as_dense
    with pytest.raises(ValueError, match="always trains under Horovod.*Received: horovod=False"):
        lms_hvd.HorovodLMSCallback(horovod=False)


def test_initial_variables_are_broadcast_once_per_model_in_the_process(one_process, monkeypatch):
    """The record of broadcast models is per process: a new callback does not broadcast a model again."""
    calls = []
    broadcast = lms_hvd.broadcast_variables
    monkeypatch.setattr(lms_hvd, "broadcast_variables", lambda v, root_rank=0: calls.append(len(v)) or broadcast(v))
    setup = _compile(zoo.mlp())
    plain = _fit(setup, epochs=1)
    state = len(setup.state())
    _assert_same(_fit(setup, [lms_hvd.HorovodLMSCallback(device=DEVICE, **SMALL)], epochs=1), plain)
    assert calls == [state]  # model and (built first) optimizer variables
    _fit(setup, [lms_hvd.HorovodLMSCallback(device=DEVICE, **SMALL)], epochs=1, reset=False)
    assert calls == [state]  # the same model and optimizer: nothing more
    # Compiled again with a new optimizer: only the new optimizer's variables.
    setup.model.compile(optimizer=keras.optimizers.SGD(0.1), loss=setup.loss, jit_compile=False)
    _fit(setup, [tflms.LMSCallback(device=DEVICE, **SMALL, horovod=True)], epochs=1, reset=False)
    assert calls == [state, len(setup.model.optimizer.variables)] and setup.model.optimizer is not setup.optimizer


def test_only_the_root_rank_prints(one_process, monkeypatch, capsys):
    setup = _compile(zoo.mlp())
    _fit(setup, [lms_hvd.HorovodLMSCallback(device=DEVICE, **SMALL, verbose=True)], verbose=1)
    root = capsys.readouterr().out
    assert "Epoch 1/2" in root and "/step" in root and "tflms plan for" in root
    # As rank 1: Keras's progress bar reads verbose=0 from the params the callback rewrote.
    monkeypatch.setattr(lms_hvd, "is_root", lambda: False)
    _compile(setup)
    cb = lms_hvd.HorovodLMSCallback(device=DEVICE, **SMALL, verbose=True)
    history, _ = _fit(setup, [cb], verbose=1)
    with tf.device(DEVICE):
        setup.model.evaluate(setup.x, setup.y, verbose=1, callbacks=[cb])
    assert capsys.readouterr().out == ""
    assert set(history) == {"loss"} and cb.params["verbose"] == 0
    # A plain callback leaves the progress bar alone.
    _fit(setup, [tflms.LMSCallback(device=DEVICE, **SMALL)], verbose=1)
    assert "Epoch 1/2" in capsys.readouterr().out


class OwnStep(keras.Sequential):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = lms_hvd.allreduce_gradients(tape.gradient(loss, self.trainable_variables))
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"my_loss": loss}


def test_own_train_step_is_refused_unless_given_as_hook(one_process):
    keras.utils.set_random_seed(3)
    model = OwnStep([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    rng = np.random.default_rng(3)
    x = tf.constant(rng.normal(size=(32, 64)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=(32,)).astype("int32"))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    setup = _compile(zoo.Setup("own", model, loss, keras.optimizers.SGD(0.1), x, y))
    plain = _fit(setup)
    keras_function = setup.model.train_function
    with pytest.raises(ValueError, match=r"overrides train_step.*allreduce_gradients.*train_step=OwnStep\.train_step"):
        _fit(setup, [lms_hvd.HorovodLMSCallback(device=DEVICE, **SMALL)])
    assert setup.model.train_function is keras_function
    cb = lms_hvd.HorovodLMSCallback(device=DEVICE, **SMALL, train_step=OwnStep.train_step)
    _assert_same(_fit(setup, [cb]), plain)
    assert len(cb.plan.swaps) >= 1


def test_bad_setups(one_process, monkeypatch):
    with pytest.raises(TypeError, match="horovod='yes'"):
        tflms.LMSCallback(horovod="yes")
    # Horovod's ranks and a multi-replica strategy do not mix.
    keras.utils.set_random_seed(8)
    strategy = tf.distribute.MirroredStrategy([HOST, DEVICE])
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
        setup = _compile(zoo.Setup("m", model, keras.losses.MeanSquaredError(), keras.optimizers.SGD(), *_xy()))
    with pytest.raises(ValueError, match="horovod=True.*2 replicas"):
        _fit(setup, [lms_hvd.HorovodLMSCallback(device=DEVICE, **SMALL)], epochs=1)
    # Started by horovodrun but Horovod never initialised: refuse instead of training alone.
    setup = _compile(zoo.mlp())
    monkeypatch.setenv("HOROVOD_RANK", "1")
    with pytest.raises(RuntimeError, match=r"tflms.integrations.horovod.init\(\)"):
        _fit(setup, [lms_hvd.HorovodLMSCallback(device=DEVICE, **SMALL)], epochs=1, verbose=1)


def _xy():
    rng = np.random.default_rng(8)
    return tf.constant(rng.normal(size=(16, 64)).astype("float32")), tf.constant(
        rng.normal(size=(16, 10)).astype("float32")
    )
