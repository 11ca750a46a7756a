"""The real-memory test bed without a GPU (the public name of :mod:`tflms.testing.testbed`,
:mod:`tflms.testing.measured` and :mod:`tflms.testing.own_model`): a measured device process
with a real allocator cap, a host process, and measurements of your own model."""

from .testing.measured import *  # noqa: F403
from .testing.measured import __all__ as _measured
from .testing.own_model import *  # noqa: F403
from .testing.own_model import __all__ as _own_model
from .testing.testbed import *  # noqa: F403
from .testing.testbed import __all__ as _testbed

__all__ = [*_testbed, *_measured, *_own_model]
