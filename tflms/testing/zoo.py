"""The model zoo that the tests, the benchmarks and the demo share: seeded models with synthetic data.

:func:`build` gives ``(model, x, y, train_step)`` for a model of :data:`MODELS` (an Adam step
with the sparse cross-entropy); :func:`fit_data` the same model compiled for ``model.fit``;
:func:`make_model` a model of :data:`MODELS` or a variant of it (the tests' small CNN and
transformer); :func:`train_step_of` the training step of a model, a loss and an optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "CNN_BLOCKS",
    "DEEP_MODELS",
    "GPT_VOCAB",
    "MODELS",
    "build",
    "fit_data",
    "make_model",
    "train_step",
    "train_step_of",
]


#: The CNN's blocks: (filters, what follows the block's Conv2D, BatchNormalization and ReLU:
#: ``"pool"`` a MaxPooling2D, a float a Dropout of that rate, None nothing).
CNN_BLOCKS: tuple[tuple[int, str | float | None], ...] = (
    (32, None),
    (32, "pool"),
    (64, "pool"),
    (64, "pool"),
    (128, "pool"),
)


def _cnn(size: int, blocks: tuple[tuple[int, str | float | None], ...] = CNN_BLOCKS, head_dropout: float = 0.0) -> Any:
    """Conv2D/BatchNormalization/ReLU ``blocks`` (:data:`CNN_BLOCKS`), global average pooling, a
    Dropout of ``head_dropout`` if any, and a Dense head of 10 logits."""
    import keras

    L = keras.layers
    layers: list[Any] = [keras.Input((size, size, 3))]
    for filters, after in blocks:
        layers += [L.Conv2D(filters, 3, padding="same"), L.BatchNormalization(), L.ReLU()]
        if after == "pool":
            layers.append(L.MaxPooling2D())
        elif after is not None:
            layers.append(L.Dropout(after))
    layers.append(L.GlobalAveragePooling2D())
    if head_dropout:
        layers.append(L.Dropout(head_dropout))
    layers.append(L.Dense(10))
    return keras.Sequential(layers)


def _resnet50(size: int) -> Any:
    import keras

    return keras.applications.ResNet50(
        weights=None, input_shape=(size, size, 3), classes=10, classifier_activation=None
    )


def _densenet121(size: int) -> Any:
    import keras

    return keras.applications.DenseNet121(
        weights=None, input_shape=(size, size, 3), classes=10, classifier_activation=None
    )


def _transformer(seq: int, dim: int = 256, heads: int = 8, layers: int = 2, dropout: float = 0.0) -> Any:
    """``layers`` post-norm blocks of self-attention (its output through a Dropout of ``dropout``
    if any) and a GELU MLP of width ``4 * dim``, global average pooling, 10 logits."""
    import keras

    L = keras.layers
    inp = keras.Input((seq, dim))
    h = inp
    for _ in range(layers):
        a = L.MultiHeadAttention(num_heads=heads, key_dim=dim // heads)(h, h)
        if dropout:
            a = L.Dropout(dropout)(a)
        h = L.LayerNormalization()(h + a)
        f = L.Dense(dim * 4, activation="gelu")(h)
        h = L.LayerNormalization()(h + L.Dense(dim)(f))
    out = L.Dense(10)(L.GlobalAveragePooling1D()(h))
    return keras.Model(inp, out)


def _twoinput(size: int) -> Any:
    """A subclassed two-input model that overrides ``train_step``: four Conv2D (ReLU) + MaxPool2D
    stages on a ``size``-pixel image, a Dense branch on a 64-wide vector, concatenated, a Dense
    head (what ``LMSCallback`` meets in user code: several inputs and a ``train_step`` of its own).
    At 128 px and batch 32 its first stage's output is 64 MiB;
    tests/testing/test_recovery_testbed.py trains it with tflms under its plain step's measured peak."""
    import keras
    import tensorflow as tf

    L = keras.layers

    class TwoInput(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.convs = [L.Conv2D(c, 3, padding="same", activation="relu") for c in (32, 64, 128, 256)]
            self.pools = [L.MaxPooling2D() for _ in self.convs]
            self.flatten = L.Flatten()
            self.vector = L.Dense(64, activation="relu")
            self.concat = L.Concatenate()
            self.hidden = L.Dense(128, activation="relu")
            self.head = L.Dense(10)

        def call(self, inputs: Any, training: bool = False) -> Any:
            image, vector = inputs
            h = image
            for conv, pool in zip(self.convs, self.pools):
                h = pool(conv(h))
            h = self.concat([self.flatten(h), self.vector(vector)])
            return self.head(self.hidden(h))

        def train_step(self, data: Any) -> dict[str, Any]:
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    model = TwoInput()
    model((keras.ops.zeros((1, size, size, 3)), keras.ops.zeros((1, 64))))  # builds the weights
    return model


def _encoder(seq: int) -> Any:
    """The transformer's blocks, 8 deep: a small encoder (BERT-base has 12 blocks of width 768)."""
    return _transformer(seq, layers=8)


#: The GPT's vocabulary: its logits at batch 24 and sequence 256 are one 187.5 MiB tensor.
GPT_VOCAB = 8000


def _gpt(seq: int, vocab: int = GPT_VOCAB, dim: int = 256, heads: int = 8, layers: int = 4) -> Any:
    """A small GPT: token and learned position embeddings, ``layers`` pre-norm blocks of causal
    self-attention and a GELU MLP, a final norm and the logits over ``vocab`` tokens per position."""
    import keras

    L = keras.layers
    tokens = keras.Input((seq,), dtype="int32")
    h = L.Embedding(vocab, dim)(tokens)
    h = h + L.Embedding(seq, dim)(keras.ops.arange(seq))  # broadcast over the batch
    for _ in range(layers):
        a = L.LayerNormalization()(h)
        h = h + L.MultiHeadAttention(num_heads=heads, key_dim=dim // heads)(a, a, use_causal_mask=True)
        f = L.Dense(dim * 4, activation="gelu")(L.LayerNormalization()(h))
        h = h + L.Dense(dim)(f)
    return keras.Model(tokens, L.Dense(vocab)(L.LayerNormalization()(h)))


def train_step_of(
    model: Any, loss_fn: Callable[[Any, Any], Any], optimizer: Any, wrap_tape: Callable[[Any], Any] | None = None
) -> Callable:
    """The training step everyone traces: the forward pass under a ``GradientTape``, ``loss_fn(y,
    prediction)``, its gradients and ``optimizer.apply_gradients``; returns the loss. ``wrap_tape``:
    what the tape is wrapped in before the gradients are taken (e.g. ``lambda tape:
    tflms.horovod.DistributedGradientTape(tape)``, gradients averaged over the ranks)."""
    import tensorflow as tf

    def train_step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if wrap_tape is not None:
            tape = wrap_tape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return train_step


def make_model(name: str, size: int | None = None, **options: Any) -> Any:
    """The model of :data:`MODELS` ``name`` at ``size`` (default: the model's), unseeded: its
    builder's ``options`` (e.g. ``blocks`` of the CNN, ``dim`` of the transformer) make variants."""
    builder, default, _ = MODELS[name]
    return builder(size or default, **options)


#: name -> (builder(size), default size, input shape from size). ``size`` is the image
#: side for CNNs and the sequence length for the transformer (width 256, 2 blocks),
#: the encoder (the same blocks, 8 deep) and the GPT (:func:`_gpt`: vocabulary
#: :data:`GPT_VOCAB`, width 256, 4 causal blocks; its inputs are token ids and its labels
#: the next token at every position).
MODELS: dict[str, tuple[Callable[..., Any], int, Callable[[int], tuple[int, ...] | list[tuple[int, ...]]]]] = {
    "cnn": (_cnn, 64, lambda s: (s, s, 3)),
    "resnet50": (_resnet50, 96, lambda s: (s, s, 3)),
    "densenet121": (_densenet121, 64, lambda s: (s, s, 3)),
    "transformer": (_transformer, 256, lambda s: (s, 256)),
    "encoder": (_encoder, 256, lambda s: (s, 256)),
    "gpt": (_gpt, 256, lambda s: (s,)),
    "twoinput": (_twoinput, 128, lambda s: [(s, s, 3), (64,)]),
}


#: The models whose depth :func:`build` can set (``layers``: their number of blocks).
DEEP_MODELS = ("transformer", "encoder", "gpt")


def build(
    name: str,
    batch: int,
    size: int | None = None,
    seed: int = 0,
    *,
    layers: int | None = None,
    width: int | None = None,
    offload_host: str | None = None,
) -> tuple[Any, Any, Any, Callable]:
    """``(model, x, y, train_step)`` for a model of :data:`MODELS`, seeded and deterministic.

    ``layers``: the number of blocks of a model of :data:`DEEP_MODELS` (default: the model's own).
    ``width``: the GPT's width (default 256; 16 attention heads from width 1024 up, else 8).
    ``offload_host``: make the Adam state on that device (:func:`tflms.build_optimizer`), for a
    step traced with ``offload="optimizer"``; by default it is made beside the weights."""
    import keras
    import numpy as np
    import tensorflow as tf

    if name not in MODELS:
        raise ValueError(f"unknown model for measuring; use one of {', '.join(MODELS)}. Received: name={name!r}")
    builder, default, shape_of = MODELS[name]
    size = size or default
    if layers is not None and name not in DEEP_MODELS:
        raise ValueError(f"layers is for {', '.join(DEEP_MODELS)} only. Received: name={name!r}, layers={layers!r}")
    if width is not None and (name != "gpt" or isinstance(width, bool) or not isinstance(width, int) or width < 16):
        raise ValueError(f"width is the GPT's, an integer >= 16. Received: name={name!r}, width={width!r}")
    keras.utils.set_random_seed(seed)
    if name == "gpt" and width is not None:
        model = _gpt(size, dim=width, heads=16 if width >= 1024 else 8, layers=layers or 4)
    elif layers is None:
        model = builder(size)
    else:
        model = _transformer(size, layers=layers) if name != "gpt" else _gpt(size, layers=layers)
    optimizer = keras.optimizers.Adam(1e-3)
    if offload_host is None:
        optimizer.build(model.trainable_variables)
    else:
        from ..integrations.offload import build_optimizer

        build_optimizer(optimizer, model.trainable_variables, offload_host)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(seed)
    shapes = shape_of(size)
    if name == "gpt":  # token ids in, the next token at every position out
        x = tf.constant(rng.integers(0, GPT_VOCAB, size=(batch, *shapes)).astype("int32"))
        y = tf.constant(rng.integers(0, GPT_VOCAB, size=(batch, *shapes)).astype("int32"))
    else:  # a model with several inputs (twoinput: an image and a vector) takes a tuple
        x = (
            tuple(tf.constant(rng.normal(size=(batch, *shape)).astype("float32")) for shape in shapes)
            if isinstance(shapes, list)
            else tf.constant(rng.normal(size=(batch, *shapes)).astype("float32"))
        )
        y = tf.constant(rng.integers(0, 10, size=(batch,)).astype("int32"))

    train_step = train_step_of(model, loss_fn, optimizer)
    train_step.optimizer = optimizer
    return model, x, y, train_step


def fit_data(name: str, batch: int, size: int | None = None, seed: int = 0) -> tuple[Any, Any, Any]:
    """``(model, x, y)`` for ``model.fit``: a model of :data:`MODELS` compiled with Adam and the
    sparse cross-entropy of :func:`build`, and one batch of its data (``x``, ``y`` as tensors of
    ``batch`` rows). A factory for :func:`tflms.testbed.measure_model`:
    ``measure_model("tflms.testing.zoo:fit_data", {"name": "resnet50", "batch": 16}, batch_size=16)``.
    """
    import keras

    model, x, y, _ = build(name, batch, size, seed)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    return model, x, y


def train_step(name: str, batch: int, size: int | None = None, seed: int = 0) -> tuple[Callable, tuple[Any, Any]]:
    """``(step, (x, y))``: the training step of :func:`build` and its inputs, a factory for
    :func:`tflms.testbed.measure_model` that trains through ``tflms.function``."""
    _, x, y, step = build(name, batch, size, seed)
    return step, (x, y)
