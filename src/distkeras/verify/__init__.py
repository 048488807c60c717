"""The checks that a distributed job trains what one device trains, backend-neutral.

- :mod:`~distkeras.verify.check`: the one-device check (``verify=``): the first step of every ``fit()`` run again
  as one device runs it, and the two compared variable by variable.
- :mod:`~distkeras.verify.datacheck`: the data check (``check_data=``): every worker draws the global batch one
  process draws.

Each backend supplies the primitives (``backends/<name>/verify.py``, ``backends/<name>/datacheck.py``, with what
the Keras 3 backends share in ``backends/verifying.py`` and ``backends/datawatch.py``). The check's names are
exported here too, so ``distkeras.verify.Check`` and ``distkeras.verify.tolerance_for`` keep working.
"""

from .check import (
    ATOL,
    DOCS,
    ENV,
    HALF_EPS,
    RTOL,
    Check,
    Difference,
    Tolerance,
    differences,
    explained_by_slots,
    log_pairs,
    message,
    mode,
    named_state,
    pairs,
    tolerance,
    tolerance_for,
)

__all__ = ["ATOL", "DOCS", "ENV", "HALF_EPS", "RTOL", "Check", "Difference", "Tolerance", "differences",
           "explained_by_slots", "log_pairs", "message", "mode", "named_state", "pairs", "tolerance", "tolerance_for"]
