"""Tools beside the pipeline: ``build_horovod`` builds, caches and installs a Horovod wheel for the
installed TensorFlow (``python -m tflms.tools.build_horovod``)."""
