"""tflms.testing.zoo: the models the tests, benchmarks and the demo share."""

import pytest

from tflms.testing.zoo import build

pytestmark = pytest.mark.integration


def test_gpt_width_and_depth_set_its_size():
    small, *_ = build("gpt", 1, 8, layers=1, width=32)
    wider, *_ = build("gpt", 1, 8, layers=1, width=64)
    deeper, *_ = build("gpt", 1, 8, layers=2, width=32)
    block = 12 * 32 * 32 + 13 * 32  # attention (4 d x d + biases), MLP (8 d x d + biases), two norms
    assert deeper.count_params() - small.count_params() == block
    assert wider.count_params() > small.count_params()
    assert wider.layers[2].output.shape[-1] == 64  # the embedding's width


@pytest.mark.parametrize(("name", "width"), [("cnn", 64), ("gpt", 8), ("gpt", True), ("gpt", 64.0)])
def test_bad_width_is_one_clear_error(name, width):
    with pytest.raises(ValueError, match=rf"width is the GPT's.*Received: name='{name}', width={width!r}"):
        build(name, 1, 8, width=width)
