"""The real-memory test bed without a GPU: the public name of :mod:`tflms.testing.testbed`."""

from .testing.testbed import *  # noqa: F403
from .testing.testbed import __all__  # noqa: F401
