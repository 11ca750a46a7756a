"""The transforms a plan decides besides its swaps, one module each: sums, tiles, recompute, the
memory-aware schedule, the optimizer's and the weights' offload, placement. Each reads the graph
model and the simulator's predictions; ``tflms.plan.registry`` runs them in order."""
