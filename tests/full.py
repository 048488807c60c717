"""The opt-in full run: DISTKERAS_FULL_TESTS=1 runs the long matrices the default run samples.

The default run (scripts/test.sh, CI) keeps at least one instance of every distinct assertion on every backend:
each compatibility pattern and each real-code program at one replica count, every replica count on several
cases, every cluster kind and every srun layout. The full run adds the rest of each matrix (every case at N=2
and N=3, every srun layout on every backend, every torchrun test on every backend); scripts/nightly.sh sets it.
What the default run leaves out is reported as skipped, with the reason, never dropped silently.
"""

import os

import pytest

#: True when DISTKERAS_FULL_TESTS is set to anything but "" or "0".
FULL = os.environ.get("DISTKERAS_FULL_TESTS", "") not in ("", "0")


def only_in_full(why):
    """A mark that skips a test outside the full run, saying why the default run doesn't need it."""
    return pytest.mark.skipif(not FULL, reason="full run only (DISTKERAS_FULL_TESTS=1): " + why)


def alternating(names, counts=(2, 3)):
    """``(name, devices)`` parameters: every name at every count in the full run; in the default run each name at
    one count, taking the counts in turn along ``names`` (sorted), so every count still runs, on other cases."""
    names = sorted(names)
    params = []
    for i, name in enumerate(names):
        for n in counts:
            default = counts[i % len(counts)] == n
            marks = () if default else only_in_full(
                "{} runs at N={} in the default run; the other cases cover N={}".format(name, counts[i % len(counts)], n))
            params.append(pytest.param(name, n, marks=marks, id="{}-{}".format(name, n)))
    return params


def at(names, default, counts=(2, 3), why=""):
    """``(name, devices)`` parameters: every name at every count in the full run; in the default run at ``default``
    only (``why``: what the other counts would add that other tests already cover)."""
    return [pytest.param(name, n, marks=() if n == default else only_in_full(why), id="{}-{}".format(name, n))
            for name in sorted(names) for n in counts]
