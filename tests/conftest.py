import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tests run against the source tree even when the package is not installed.
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, ROOT)

import gc  # noqa: E402

import pytest  # noqa: E402

_frozen_for = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """At each test module's first test, move every object alive so far into the collector's permanent generation
    (gc.freeze()). A backend's suite runs hundreds of models in one process and Keras and the frameworks keep
    much of each alive (traced functions, graphs); every full collection then walked all of it, each slower than
    the last: on TensorFlow about a quarter of the suite's time, and a minute more at exit (pytest collects twice
    there). Frozen objects are never walked again; what the tests under way make is collected as always."""
    module = getattr(item, "module", None)
    if module is not None and (not _frozen_for or _frozen_for[-1] is not module):
        _frozen_for[:] = [module]
        gc.freeze()
