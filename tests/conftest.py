"""Test setup: split the CPU into two logical devices before TensorFlow starts.

``/device:CPU:1`` plays the GPU (the compute device), ``/device:CPU:0`` the host.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
tf.config.experimental.enable_op_determinism()

DEVICE = "/device:CPU:1"
HOST = "/device:CPU:0"
