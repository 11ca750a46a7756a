"""The step as data: a traced step (a ``ConcreteFunction``; a Keras model's train step is traced
by ``tflms.ir.trace``) as a ``GraphModel``, a DAG of ops and tensors with levels and phases, and the
decisions a plan is made of (swaps, recomputes, fences, orders) as frozen records."""
