"""Plans: from an ``ir`` graph model and the ``emulate`` stage's predictions, the candidates, the
ordered pass registry, the planner and the autotuner that make a ``SwapPlan`` for a budget, and the
capacity search for the largest batch; the passes themselves are in ``tflms.plan.passes``."""
