"""A ``plan`` stage's ``SwapPlan`` applied to a copy of the TensorFlow graph, one applier a pass in
registry order (swap-outs, host-gated swap-ins, clones, ordering edges), and rebuilt as a new
``ConcreteFunction``."""
