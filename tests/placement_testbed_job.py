"""The two-device test bed's job as a script, for ``tests/testing/test_placement_testbed.py``:
``python tests/placement_testbed_job.py MODE BATCH CAP_MIB [MODEL]`` runs
:func:`tflms.testing.placement_job.cli` (the job lives there; ``benchmarks/placement_testbed.py``
runs it too)."""

from tflms.testing.placement_job import cli

if __name__ == "__main__":
    cli()
