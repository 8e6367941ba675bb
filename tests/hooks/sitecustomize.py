"""Imported by Python at start-up when tests/hooks is on PYTHONPATH (the failure tests set it):
installs the test-only fault injection of tests/hooks/faults.py around utils/log.py, from
outside the example.
The repository root goes at the end of sys.path, as every example puts it, so `horovod` and `deepspeed` stay
the installed libraries."""
import os
import sys

if any(os.environ.get(v) for v in ("COURSE_FAIL_AT", "COURSE_DIE_IN_WRITE", "COURSE_DIE_ON_FILE", "COURSE_PLANT",
                                   "COURSE_MONITOR", "COURSE_DATA_ORDER")):
    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import faults  # tests/hooks/faults.py (this folder is on the path)

    faults.stop_before_join()
    faults.install()
    faults.refuse_at_step()
