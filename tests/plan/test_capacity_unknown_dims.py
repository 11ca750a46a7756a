"""max_batch_size refuses a step whose inputs leave a dimension besides the batch unknown (issue 62).

KerasHub's models take ``keras.Input(shape=(None,))``: traced as they are, the sequence length is
unknown and was sized as 1, so the capacity search answered for a sequence of length 1 (GPT-2
at 1 GiB: "5636 without LMS"). It now names the inputs and dimensions and says how to trace the
step with concrete shapes; with concrete shapes the answer is the largest batch whose predicted
peak fits.
"""

import re
import warnings

import keras
import pytest
import tensorflow as tf

import tflms
from tflms import Simulator
from tflms.ir.trace import graph_source, keras_train_step
from tflms.plan import capacity

pytestmark = pytest.mark.integration

L = keras.layers
SEQ = 16


def sequence_model(length):
    """Token ids (batch, length) -> per-token class scores, a sparse loss: labels (batch, length)."""
    tokens = keras.Input((length,), dtype="int32", name="tokens")
    h = L.Dense(32, activation="relu")(L.Embedding(100, 16)(tokens))
    model = keras.Model(tokens, L.Dense(10)(h))
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    return model


@pytest.fixture(scope="module")
def open_length():
    return sequence_model(None)


def test_a_keras_model_with_an_unknown_sequence_length_is_refused_naming_the_input_and_dimension(open_length):
    for call in (
        lambda: tflms.max_batch_size(open_length, "64MiB"),
        lambda: capacity.batch_bound(open_length, "64MiB"),
    ):
        with pytest.raises(ValueError) as err:
            call()
        text = str(err.value)
        assert "input 'tokens' has an unknown dimension 1 (shape [?, ?])" in text
        assert "the labels have an unknown dimension 1 (shape [?, ?])" in text
        assert "tf.TensorSpec([None, 128], tf.int32)" in text and "keras.Input(shape=(128,)" in text  # what to do
        assert "Received: step=the Keras model" in text and "inputs (None, None) int32" in text
    assert text.startswith("batch_bound cannot size the step:")


def test_a_concrete_function_or_factory_with_unknown_dimensions_is_refused():
    step = tf.function(lambda x: tf.reduce_sum(x * x))
    open_image = step.get_concrete_function(tf.TensorSpec([None, None, None, 3], tf.float32, name="image"))
    with pytest.raises(
        ValueError, match=re.escape("input 'image' has unknown dimensions 1 and 2 (shape [?, ?, ?, 3])")
    ):
        tflms.max_batch_size(open_image, "64MiB")
    no_rank = step.get_concrete_function(tf.TensorSpec(None, tf.float32, name="x"))
    with pytest.raises(ValueError, match=re.escape("input 'x' has an unknown rank")):
        tflms.max_batch_size(no_rank, "64MiB")

    per_batch = tf.function(lambda x: tf.reduce_sum(x * x))  # a function of its own: no trace of unknown rank

    def factory(batch):
        return per_batch.get_concrete_function(tf.TensorSpec([batch, None], tf.float32, name="x"))

    with pytest.raises(ValueError) as err:
        tflms.max_batch_size(factory, "64MiB")
    assert "input 'x' has an unknown dimension 1 (shape [" in str(err.value)
    assert "Received: step=a factory whose ConcreteFunction at batch_size=" in str(err.value)


def test_a_concrete_function_whose_batch_cannot_vary_is_refused():
    step = tf.function(lambda x: tf.reduce_sum(x * x)).get_concrete_function(tf.TensorSpec([8, 32], name="x"))
    with pytest.raises(ValueError) as err:
        tflms.max_batch_size(step, "64MiB")
    assert "input 'x' has shape [8, 32]" in str(err.value) and "tf.TensorSpec([None, 32], ...)" in str(err.value)


def _check_largest(graph_of, budget, answer):
    """``answer`` is the largest batch whose plain step's predicted peak fits ``budget``."""
    assert 1 <= answer
    assert Simulator(graph_of(answer)).peak() <= budget < Simulator(graph_of(answer + 1)).peak()


def test_with_concrete_shapes_the_answer_is_the_largest_batch_whose_peak_fits(open_length):
    model = sequence_model(SEQ)
    graph_of = graph_source(model)
    budget = Simulator(graph_of(8)).peak() + 1000
    result = tflms.max_batch_size(model, budget, limit=32, policy="none", knobs=tflms.Knobs(serialize=False))
    _check_largest(graph_of, budget, result.without_lms)
    assert result.without_lms >= 8 and result.with_lms >= result.without_lms
    # What the error says to do: the model of unknown length, wrapped on inputs of a concrete length.
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    wrapped = keras.Model(tokens, open_length(tokens))
    wrapped.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    answer = tflms.max_batch_size(
        wrapped, budget, limit=32, policy="none", knobs=tflms.Knobs(serialize=False)
    ).without_lms
    _check_largest(graph_source(wrapped), budget, answer)
    # A ConcreteFunction with the batch alone unknown: sized per batch, no retracing (as before), with a
    # warning here (its Dense reshapes sized as batch x 1 rows).
    traced = keras_train_step(model)
    assert capacity.unknown_dims(traced, model) == []
    with pytest.warns(UserWarning, match="does not tell the size"):
        answer = tflms.max_batch_size(
            traced, budget, limit=32, policy="none", knobs=tflms.Knobs(serialize=False)
        ).without_lms
    _check_largest(graph_source(traced), budget, answer)


def test_a_concrete_function_whose_forward_sizes_the_batch_does_not_tell_warns():
    """A Dense on (batch, length, 16) reshapes it to (None, None) when the batch is unknown: batch x length rows
    sized as batch x 1. The ConcreteFunction is sized with a warning; the Keras model is traced per batch."""
    model = sequence_model(SEQ)
    with pytest.warns(UserWarning, match=r"the unknown batch does not tell the size of \d+ forward tensor"):
        tflms.plan.capacity.batch_bound(keras_train_step(model), "64MiB", limit=64)
    flat = keras.Sequential([keras.Input((SEQ,)), L.Dense(8), L.Dense(2)])
    flat.compile("adam", "sparse_categorical_crossentropy", jit_compile=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capacity.batch_bound(keras_train_step(flat), "64MiB", limit=64)
