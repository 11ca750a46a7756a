"""KerasHub tasks built from configs (random weights, no preset is downloaded), with their data.

One builder per model of the ecosystem tier; every test of ``tests/ecosystem/`` (and the test bed's
job :func:`tflms.testing.jobs.keras_hub_gpt2_fit`) builds its model here. A :class:`Case` keeps the model's
initial state, its optimizer's included (built before the first step, so Adam's slots and iteration
count are in it), and restores it with :meth:`Case.reset`: a plain and an LMS ``fit`` then start
from the same state on the same model object (DESIGN.md §2: two builds in one process may train
differently).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

#: The batch of every case: the plans must be made for it (not for None or 1).
BATCH = 8
#: The token sequence length of the text models.
SEQUENCE = 128
#: Training steps per fit: ``STEPS * BATCH`` samples, one epoch, ``shuffle=False``.
STEPS = 3


@dataclasses.dataclass
class Case:
    """A compiled KerasHub task, ``STEPS`` batches of its inputs, and its initial state."""

    name: str
    model: keras.Model
    x: Any  # a dict of numpy arrays (text) or an array (images)
    y: np.ndarray
    sample_weight: np.ndarray | None = None
    _initial: list[np.ndarray] = dataclasses.field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        # Built now, so that the initial state holds Adam's slots and iteration count (zeros).
        self.model.optimizer.build(self.model.trainable_variables)
        self._initial = [np.array(v.numpy()) for v in self.state()]

    def state(self) -> list:
        """Every variable training changes: the model's (weights, Keras seed-generator states of the
        dropouts) and the optimizer's (Adam's moments, iterations, learning rate)."""
        return list(self.model.variables) + list(self.model.optimizer.variables)

    def reset(self) -> None:
        """Restore the initial state: the weights as built and a fresh optimizer's state."""
        for v, value in zip(self.state(), self._initial, strict=True):
            v.assign(value)

    def fit_kwargs(self) -> dict[str, Any]:
        """Arguments of ``model.fit`` for ``STEPS`` steps of ``BATCH`` in one epoch, in order."""
        kwargs: dict[str, Any] = {"x": self.x, "y": self.y, "batch_size": BATCH, "epochs": 1, "shuffle": False}
        if self.sample_weight is not None:
            kwargs["sample_weight"] = self.sample_weight
        return kwargs


#: The text models' sizes (GPT-2, BERT, BART): vocabulary 5000, 4 heads, hidden 256, intermediate 1024.
TEXT = {
    "vocabulary_size": 5000,
    "num_heads": 4,
    "hidden_dim": 256,
    "intermediate_dim": 1024,
    "max_sequence_length": SEQUENCE,
}


def _next_tokens(ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A language model's labels (the next token at each position) and their weights (the mask)."""
    labels = np.concatenate([ids[:, 1:], np.zeros_like(ids[:, :1])], axis=1)
    weights = np.concatenate([mask[:, 1:], np.zeros_like(mask[:, :1])], axis=1).astype("float32")
    return labels, weights


def _compile(model: keras.Model) -> keras.Model:
    # The task's own loss ("auto": sparse cross-entropy from logits) and Adam; no XLA (it would drop swaps).
    model.compile(optimizer=keras.optimizers.Adam(1e-3), jit_compile=False)
    return model


def _tokens(rng: np.random.Generator, vocabulary: int, samples: int = STEPS * BATCH) -> tuple[np.ndarray, np.ndarray]:
    """Random token ids and a padding mask whose sequences end at different lengths."""
    ids = rng.integers(1, vocabulary, size=(samples, SEQUENCE)).astype("int32")
    lengths = rng.integers(SEQUENCE // 2, SEQUENCE + 1, size=(samples, 1))
    mask = np.arange(SEQUENCE)[None, :] < lengths
    return np.where(mask, ids, 0).astype("int32"), mask


def gpt2(seed: int = 11) -> Case:
    """``GPT2CausalLM``: vocabulary 5000, 4 layers, 4 heads, hidden 256, intermediate 1024, max
    sequence 128; next-token labels, the padding mask as sample weight."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(**TEXT, num_layers=4)
    model = _compile(keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None))
    rng = np.random.default_rng(seed)
    ids, mask = _tokens(rng, 5000)
    labels, weights = _next_tokens(ids, mask)
    return Case("gpt2", model, {"token_ids": ids, "padding_mask": mask}, labels, weights)


def bert(seed: int = 12) -> Case:
    """``BertTextClassifier`` of GPT-2's size (2 classes), two segments per sequence."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(**TEXT, num_layers=4)
    model = _compile(keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2, preprocessor=None))
    rng = np.random.default_rng(seed)
    ids, mask = _tokens(rng, 5000)
    segments = (np.arange(SEQUENCE)[None, :] >= SEQUENCE // 2).astype("int32") * mask
    labels = rng.integers(0, 2, size=(STEPS * BATCH,)).astype("int32")
    x = {"token_ids": ids, "segment_ids": segments, "padding_mask": mask}
    return Case("bert", model, x, labels)


def vit(seed: int = 13) -> Case:
    """``ViTImageClassifier``: 32x32 RGB images, patch 4 (64 patches and a class token), 4 layers,
    4 heads, hidden 128, MLP 512, 10 classes."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(32, 32, 3), patch_size=4, num_layers=4, num_heads=4, hidden_dim=128, mlp_dim=512
    )
    model = _compile(keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=10, preprocessor=None))
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(STEPS * BATCH, 32, 32, 3)).astype("float32")
    labels = rng.integers(0, 10, size=(STEPS * BATCH,)).astype("int32")
    return Case("vit", model, images, labels)


def bart(seed: int = 14) -> Case:
    """``BartSeq2SeqLM``, an encoder-decoder: vocabulary 5000, 2 encoder and 2 decoder layers, 4 heads,
    hidden 256, intermediate 1024, 128 tokens in and out; the decoder's padding mask as sample weight."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BartBackbone(**TEXT, num_layers=2)
    model = _compile(keras_hub.models.BartSeq2SeqLM(backbone=backbone, preprocessor=None))
    rng = np.random.default_rng(seed)
    enc, enc_mask = _tokens(rng, 5000)
    dec, dec_mask = _tokens(rng, 5000)
    labels, weights = _next_tokens(dec, dec_mask)
    x = {
        "encoder_token_ids": enc,
        "encoder_padding_mask": enc_mask,
        "decoder_token_ids": dec,
        "decoder_padding_mask": dec_mask,
    }
    return Case("bart", model, x, labels, weights)


#: The builders by name, in the order the tier runs them.
MODELS: dict[str, Callable[..., Case]] = {"gpt2": gpt2, "bert": bert, "vit": vit, "bart": bart}
