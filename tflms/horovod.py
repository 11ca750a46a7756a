"""Horovod data parallelism for tflms steps: the public name of :mod:`tflms.integrations.horovod`.

Example (run with ``horovodrun --gloo -np 2 -H localhost:2 python train.py``)::

    import tflms.horovod as lms_hvd
    lms_hvd.init()
"""

from .integrations.horovod import *  # noqa: F403
from .integrations.horovod import __all__, __dir__, __getattr__  # noqa: F401
