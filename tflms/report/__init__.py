"""A plan for people: the ``emulate`` simulator's predicted memory timeline of a step, before and
after its plan, as a plot, and the short plan summaries ``LMSCallback`` prints."""
