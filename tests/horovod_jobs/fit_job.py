"""Worker of tests/test_horovod_keras.py, started by ``horovodrun --gloo -np 2``.

``model.fit`` with ``tflms.integrations.horovod.HorovodLMSCallback`` (in one place spelt
``tflms.LMSCallback(horovod=True)``, which makes the same), each rank on its own shard
of the data. Cases (``--cases``, run in this order in one process):

* ``horovod``: the CNN of jobkit built from a rank-dependent seed, 2 epochs with
  validation (progress bar and plan summary on), then a second ``fit`` of 1 epoch
  with a new callback (made by ``tflms.LMSCallback(horovod=True)``). Writes
  ``initial.npz`` (rank 0, after the broadcast) and per rank the final state, the
  ``History`` and the batch logs.
* ``offload``: the ``horovod`` case with ``offload="optimizer"``: the optimizer's state and
  update on the host, so the gradients are averaged there. Writes ``offload_initial.npz``.
* ``placed``: the ``horovod`` case with ``devices=jobkit.PLACED``: each rank places its step on
  its own two devices. Writes ``placed_initial.npz``.
* ``plain``: the negative control: the same CNN from the *same* seed on every rank,
  ``tflms.LMSCallback()`` without ``horovod``: nothing is averaged.
* ``bn``: the CNN with BatchNormalization, ``steps_per_execution=2``; rank 1's
  moving statistics are set to other values before ``fit`` (the broadcast must
  undo that).
* ``subclassed``: a subclassed MLP never called before ``fit`` (variables created
  at the first step: broadcast then), rank-dependent seed.
* ``eager``: a functional MLP compiled with ``run_eagerly=True`` (no LMS, gradients
  still averaged), rank-dependent seed.
* ``own_step``: a model with its own ``train_step`` passed as
  ``HorovodLMSCallback(train_step=...)``: once averaging its gradients with
  ``tflms.integrations.horovod.allreduce_gradients``, once forgetting to (a warning, ranks differ).

Per rank ``<out>/<case>_rank<r>.npz`` (final model + optimizer variables) and
``<out>/rank<r>.json`` (histories, batch logs, plans, structure, broadcast calls).
Importing this module touches no TensorFlow device: the test imports it for the
models and the data.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jobkit

B = jobkit.PER_RANK_BATCH
STEPS = 4  # batches per epoch and rank
EPOCHS = 2
VAL_STEPS = 2
CASES = ("horovod", "offload", "placed", "plain", "bn", "subclassed", "eager", "own_step")
MLP_FEATURES = 32


def optimizer():
    import keras

    return keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)


def compile_model(model, metrics=("accuracy",), **kwargs):
    model.compile(
        optimizer=optimizer(), loss=jobkit.loss_fn(), metrics=list(metrics) or None, jit_compile=False, **kwargs
    )
    return model


def images(n: int, seed: int):
    """``n`` images and labels; rank r's shard of each global batch of ``2 B`` is rows [r B, (r+1) B)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *jobkit.IMAGE)).astype("float32")
    y = rng.integers(0, jobkit.CLASSES, size=(n,)).astype("int32")
    return x, y


def features(n: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, MLP_FEATURES)).astype("float32")
    y = rng.integers(0, jobkit.CLASSES, size=(n,)).astype("int32")
    return x, y


def shard(data, rank: int, size: int):
    """Rank ``rank``'s rows: its ``B`` rows of every global batch of ``size * B``."""
    x, y = data
    n = len(x) // (size * B)
    idx = [k * size * B + rank * B + i for k in range(n) for i in range(B)]
    return x[idx], y[idx]


def train_data(size: int):
    return images(STEPS * size * B, seed=11)


def val_data(size: int):
    return images(VAL_STEPS * size * B, seed=12)


def build_bn_cnn(seed: int):
    import keras

    keras.utils.set_random_seed(seed)
    L = keras.layers
    return keras.Sequential(
        [
            keras.Input(jobkit.IMAGE),
            L.Conv2D(8, 3, padding="same"),
            L.BatchNormalization(),
            L.ReLU(),
            L.Conv2D(8, 3, padding="same", activation="relu"),
            L.MaxPooling2D(),
            L.Flatten(),
            L.Dense(jobkit.CLASSES),
        ]
    )


def build_mlp(seed: int):
    import keras

    keras.utils.set_random_seed(seed)
    L = keras.layers
    return keras.Sequential(
        [keras.Input((MLP_FEATURES,)), L.Dense(64, activation="relu"), L.Dense(64, activation="relu"), L.Dense(10)]
    )


def subclassed_mlp(seed: int):
    import keras

    class MLP(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = [keras.layers.Dense(64, activation="relu") for _ in range(2)]
            self.out = keras.layers.Dense(jobkit.CLASSES)

        def call(self, x):
            for layer in self.hidden:
                x = layer(x)
            return self.out(x)

    keras.utils.set_random_seed(seed)
    return MLP()


def rank_seed(rank: int) -> int:
    return 0 if rank == 0 else 100 + rank


def state(model) -> list:
    return list(model.variables) + list(model.optimizer.variables)


class Recorder:
    """A Keras callback (made lazily: keras is imported after split_cpu) recording what it sees."""

    @staticmethod
    def make():
        import keras

        class _Recorder(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.batch_logs: list[dict] = []
                self.at_begin: list[list] = []  # model and optimizer variables
                self.model_at_begin: list[list] = []  # model variables

            def on_train_begin(self, logs=None):
                self.at_begin.append([v.numpy() for v in state(self.model)])
                self.model_at_begin.append([v.numpy() for v in self.model.variables])

            def on_train_batch_end(self, batch, logs=None):
                self.batch_logs.append({k: float(v) for k, v in (logs or {}).items()})

        return _Recorder()


def rewritten_structure(cb, x, y) -> dict:
    """Swap and Horovod ops in the rewritten step of ``cb`` for one batch (:func:`jobkit.graph_structure`),
    and the devices of the optimizer's state."""
    import tensorflow as tf

    graph = cb.step.get_concrete_function((tf.constant(x[:B]), tf.constant(y[:B]))).graph
    optimizer_state = sorted({v.value.device for v in cb.model.optimizer.variables})
    return jobkit.graph_structure(graph) | {"optimizer_state_devices": optimizer_state}


def plan_report(cb) -> dict:
    plan = cb.plan
    return {
        "fingerprint": cb.fingerprint,
        "plan_fingerprint": plan.fingerprint(),
        "n_swaps": len(plan.swaps),
        "device": plan.options.get("device"),
        "n_plans": len(cb.plans),
    }


def save(out: str, name: str, arrays: list) -> None:
    import numpy as np

    np.savez(os.path.join(out, name), *arrays)


def run_horovod(out: str, rank: int, size: int, report: dict, offload: str | None = None, placed: bool = False) -> None:
    import tflms
    import tflms.integrations.horovod as lms_hvd

    case = "offload" if offload else "placed" if placed else "horovod"
    options = {**jobkit.LMS_OPTIONS, "offload": offload}
    if placed:  # each rank places its step on its own two devices
        options = {k: v for k, v in options.items() if k != "device"} | {"devices": list(jobkit.PLACED)}
    model = compile_model(jobkit.build_cnn(rank_seed(rank)))
    x, y = shard(train_data(size), rank, size)
    val = shard(val_data(size), rank, size)
    lms = lms_hvd.HorovodLMSCallback(verbose=case == "horovod", **options)  # one case prints (test_only_rank_0_prints)
    pre, rec = Recorder.make(), Recorder.make()  # before and after the LMSCallback
    first = model.fit(
        x, y, batch_size=B, epochs=EPOCHS, shuffle=False, validation_data=val, callbacks=[pre, lms, rec]
    ).history
    initial = rec.at_begin[0]
    if rank == 0:
        save(out, "initial.npz" if case == "horovod" else f"{case}_initial.npz", initial)
    again = tflms.LMSCallback(horovod=True, **options)  # a new callback: still no second broadcast
    assert type(again) is tflms.LMSCallback and again.horovod  # the same callback, in its Horovod mode
    second = model.fit(x, y, batch_size=B, epochs=1, shuffle=False, callbacks=[again, rec], verbose=0).history
    save(out, f"{case}_rank{rank}.npz", [v.numpy() for v in state(model)])
    report[case] = {
        "history": first,
        "history_second_fit": second,
        "batch_logs": rec.batch_logs,
        "begin_digests": [jobkit.digest(s) for s in rec.at_begin],
        "model_digests": {
            "before_broadcast": jobkit.digest(pre.model_at_begin[0]),
            "after_broadcast": jobkit.digest(rec.model_at_begin[0]),
        },
        "optimizer_built_before_broadcast": len(pre.at_begin[0]) == len(rec.at_begin[0]),
        "n_state": len(state(model)),
        "plan": plan_report(lms),
        "plan_second_fit": plan_report(again),
        "structure": rewritten_structure(lms, x, y),
    }


def run_plain(out: str, rank: int, size: int, report: dict) -> None:
    import tflms

    model = compile_model(jobkit.build_cnn(0))  # the same initial weights on every rank
    model.optimizer.build(model.trainable_variables)  # as HorovodLMSCallback does: the same initial state
    x, y = shard(train_data(size), rank, size)
    rec = Recorder.make()
    lms = tflms.LMSCallback(**jobkit.LMS_OPTIONS)
    history = model.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=False, callbacks=[lms, rec], verbose=0).history
    save(out, f"plain_rank{rank}.npz", [v.numpy() for v in state(model)])
    report["plain"] = {
        "history": history,
        "begin_digest": jobkit.digest(rec.at_begin[0]),
        "n_swaps": len(lms.plan.swaps),
    }


def run_bn(out: str, rank: int, size: int, report: dict) -> None:
    import numpy as np

    import tflms.integrations.horovod as lms_hvd

    model = compile_model(build_bn_cnn(rank_seed(rank)), steps_per_execution=2)
    bn = model.layers[1]
    if rank == 1:  # rank-local moving statistics that the broadcast must replace
        bn.moving_mean.assign(np.full(bn.moving_mean.shape, 0.5, "float32"))
        bn.moving_variance.assign(np.full(bn.moving_variance.shape, 2.0, "float32"))
    x, y = shard(train_data(size), rank, size)
    lms = lms_hvd.HorovodLMSCallback(**jobkit.LMS_OPTIONS)
    rec = Recorder.make()
    history = model.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=False, callbacks=[lms, rec]).history
    trainable = {id(v) for v in model.trainable_variables}
    non_trainable = [v for v in model.variables if id(v) not in trainable]
    save(out, f"bn_trainable_rank{rank}.npz", [v.numpy() for v in model.trainable_variables])
    save(out, f"bn_moving_rank{rank}.npz", [bn.moving_mean.numpy(), bn.moving_variance.numpy()])
    at_begin = {v.path: a for v, a in zip(state(model), rec.at_begin[0])}
    report["bn"] = {
        "history": history,
        "non_trainable": [v.path for v in non_trainable],
        "plan": plan_report(lms),
        "moving_at_begin_digest": jobkit.digest([at_begin[bn.moving_mean.path], at_begin[bn.moving_variance.path]]),
        "all_at_begin_digest": jobkit.digest(rec.at_begin[0]),
    }


def run_subclassed(out: str, rank: int, size: int, report: dict) -> None:
    import tflms.integrations.horovod as lms_hvd

    model = compile_model(subclassed_mlp(rank_seed(rank)))
    assert not model.built and not model.variables
    x, y = shard(features(STEPS * size * B, seed=13), rank, size)
    lms = lms_hvd.HorovodLMSCallback(**{**jobkit.LMS_OPTIONS, "knobs": jobkit.KNOBS.replace(batch_size=B)})
    history = model.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=False, callbacks=[lms], verbose=0).history
    save(out, f"subclassed_rank{rank}.npz", [v.numpy() for v in state(model)])
    report["subclassed"] = {"history": history, "plan": plan_report(lms), "n_state": len(state(model))}


def run_eager(out: str, rank: int, size: int, report: dict) -> None:
    import warnings

    import tflms
    import tflms.integrations.horovod as lms_hvd

    model = compile_model(build_mlp(rank_seed(rank)), run_eagerly=True)
    x, y = shard(features(STEPS * size * B, seed=14), rank, size)
    lms = lms_hvd.HorovodLMSCallback(**jobkit.LMS_OPTIONS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=False, callbacks=[lms], verbose=0).history
    save(out, f"eager_rank{rank}.npz", [v.numpy() for v in state(model)])
    report["eager"] = {
        "history": history,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, tflms.LMSWarning)],
        "step": None if lms.step is None else repr(lms.step),
    }


def own_step_model(seed: int, average: bool):
    """A functional MLP whose own train_step averages its gradients (or, ``average=False``, forgets to)."""
    import keras
    import tensorflow as tf

    import tflms.integrations.horovod as lms_hvd

    class OwnStep(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            if average:
                grads = lms_hvd.allreduce_gradients(grads)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"my_loss": loss}

    keras.utils.set_random_seed(seed)
    inp = keras.Input((MLP_FEATURES,))
    h = keras.layers.Dense(64, activation="relu")(keras.layers.Dense(64, activation="relu")(inp))
    return OwnStep(inp, keras.layers.Dense(jobkit.CLASSES)(h))


def run_own_step(out: str, rank: int, size: int, report: dict) -> None:
    """A model with its own train_step, passed as HorovodLMSCallback(train_step=...)."""
    import warnings

    import tflms
    import tflms.integrations.horovod as lms_hvd

    x, y = shard(features(STEPS * size * B, seed=15), rank, size)
    report["own_step"] = {}
    for average in (True, False):
        model = compile_model(own_step_model(rank_seed(rank), average), metrics=())
        lms = lms_hvd.HorovodLMSCallback(train_step=type(model).train_step, **jobkit.LMS_OPTIONS)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(x, y, batch_size=B, epochs=1, shuffle=False, callbacks=[lms], verbose=0).history
        kind = "averaged" if average else "unaveraged"
        save(out, f"own_step_{kind}_rank{rank}.npz", [v.numpy() for v in state(model)])
        report["own_step"][kind] = {
            "history": history,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, tflms.LMSWarning)],
            "n_swaps": len(lms.plan.swaps),
        }


RUNNERS = {
    "horovod": run_horovod,
    "offload": functools.partial(run_horovod, offload="optimizer"),
    "placed": functools.partial(run_horovod, placed=True),
    "plain": run_plain,
    "bn": run_bn,
    "subclassed": run_subclassed,
    "eager": run_eager,
    "own_step": run_own_step,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()

    jobkit.split_cpu()
    import tflms.integrations.horovod as lms_hvd

    lms_hvd.init()
    rank, size = lms_hvd.rank(), lms_hvd.size()
    broadcasts: list[int] = []
    original = lms_hvd.broadcast_variables

    def counting_broadcast(variables, root_rank=0):
        variables = list(variables)
        broadcasts.append(len(variables))
        return original(variables, root_rank=root_rank)

    lms_hvd.broadcast_variables = counting_broadcast  # HorovodLMSCallback calls it through the package
    report: dict = {"rank": rank, "size": size}
    for case in args.cases.split(","):
        broadcasts.clear()
        RUNNERS[case](args.out, rank, size, report)
        report[case]["broadcasts"] = list(broadcasts)
        print(f"rank {rank}: {case} done", file=sys.stderr, flush=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
