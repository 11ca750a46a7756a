"""What TensorFlow will do with an ``ir`` graph model: the executor's order, Grappler's and oneDNN's
rewrites, the BFC allocator, op costs and the step's timeline; the simulator predicts the step's
device memory, plain or with a plan's decisions."""
