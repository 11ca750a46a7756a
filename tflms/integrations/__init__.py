"""What a user calls, built on the stages before: ``tflms.function`` and ``tflms.optimize`` (trace,
plan and rewrite a step), ``LMSCallback`` for Keras, Horovod, the device's memory, the recovery
from out-of-memory errors and the placement across devices."""
