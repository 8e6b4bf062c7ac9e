"""The suite's `xdist_group` marks reach pytest-xdist's scheduler.

Modules that must run on one worker (a Ray cluster per process in tests/serve/test_ray.py, one
wheel build in the checkout in tests/test_platforms.py) mark themselves `xdist_group`, and the
suite runs with `--dist loadgroup` (pyproject.toml). pytest-xdist 3.8 applies a group by
appending "@group" to the item's `_nodeid` on the worker; pytest 9.2 derives `nodeid` from
another attribute, so the suffix never reached the scheduler and the groups were split across
workers silently (two wheel builds then collided in build/). The test extra keeps pytest below
9.2; this test fails where a group does not reach the scheduler.
"""

import pytest

pytestmark = pytest.mark.xdist_group("probe")


def test_a_grouped_test_carries_its_group_to_the_scheduler(request):
    if not hasattr(request.config, "workerinput"):
        pytest.skip("not run by a pytest-xdist worker")
    if not request.config.getvalue("loadgroup"):
        pytest.skip("not run with --dist loadgroup")
    assert request.node.nodeid.endswith("@probe"), request.node.nodeid
