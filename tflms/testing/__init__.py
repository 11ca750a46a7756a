"""The test bed and what measures on it: measured processes with a capped BFC allocator, the
measurement harness, your own model measured, the model zoo, injected faults and the demo; they
run the ``integrations`` on real steps."""
