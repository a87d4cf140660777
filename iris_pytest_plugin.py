"""iris's pytest plugin (entry point ``pytest11``): the ``iris_ranks`` marker and the ``rank_ctx`` fixture.

pytest loads this module in every run of every project where iris is installed, so it imports
neither torch nor the ``iris`` package: a run whose tests do not use the marker pays nothing for
it. The machinery (spawning ranks, making their contexts, reporting their failures) lives in
:mod:`iris.testing`, imported when a marked test is called. See :mod:`iris.testing` for the usage.
"""

from __future__ import annotations

import pytest

#: The marker's name.
MARKER = "iris_ranks"


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", f"{MARKER}(n, backend=None, heap_size=None, timeout=120): run the test on "
                                       "n ranks (GPUs when enough are visible, else CPU ranks), each with its own "
                                       "context passed as rank_ctx")


@pytest.fixture
def rank_ctx(request):
    """The context of the rank a ``@pytest.mark.iris_ranks(n)`` test runs on (made in each rank)."""
    if request.node.get_closest_marker(MARKER) is None:
        raise pytest.UsageError(f"rank_ctx is only for tests marked @pytest.mark.{MARKER}(n)")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    marker = pyfuncitem.get_closest_marker(MARKER)
    if marker is None:
        return None
    from iris.testing import run_marked_test  # torch and iris load here, for marked tests only

    run_marked_test(pyfuncitem, marker)
    return True
