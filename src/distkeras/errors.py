"""The exceptions distkeras raises.

Every error derives from :class:`DistKerasError`, so ``except distkeras.DistKerasError`` catches all
of them. Each subclass is also the builtin exception a caller would expect for that kind of mistake
(an argument error is a ``ValueError``, a missing framework an ``ImportError``), so code written
against the builtins keeps working.

This module is part of the Python 3.6-compatible core (see DESIGN.md).
"""


class DistKerasError(Exception):
    """Base class of every error raised by distkeras."""


class DeviceSpecError(DistKerasError, ValueError):
    """The ``devices`` argument is malformed, duplicated, empty, or names a device that isn't there."""


class BackendError(DistKerasError, ValueError):
    """The Keras backend is unknown or not supported by distkeras."""


class BackendUnavailableError(DistKerasError, ImportError):
    """The framework a backend needs is not installed."""


class ModelError(DistKerasError, ValueError):
    """The model can't be distributed as given (not built, not clonable, not a Keras model)."""


class ModelTypeError(ModelError, TypeError):
    """:func:`distkeras.distribute` was given something that is no ``keras.Model``: a layer, a function, an
    array. (Both a :class:`ModelError` and a ``TypeError``.)"""


class OptionError(DistKerasError, ValueError):
    """An option passed through ``**options`` is unknown to the active backend, or has a bad value."""


class ShardError(DistKerasError, ValueError):
    """Bad arguments to :func:`distkeras.shard` (a rank outside 0..workers-1, arrays of unequal length)."""


class ClusterError(DistKerasError, ValueError):
    """The multi-worker environment (TF_CONFIG, RANK/WORLD_SIZE, MPI variables) is malformed."""


class TooLateError(DistKerasError, RuntimeError):
    """A setting that must come before the backend initialises came after it."""


class LaunchError(DistKerasError, RuntimeError):
    """Starting, watching or stopping worker processes failed."""


class LoopError(DistKerasError, RuntimeError):
    """A hand-written training loop on a distributed model misses one of the calls of :mod:`distkeras.loops`
    (an optimizer not attached, a step not run per replica) or gave one of them what it can't take."""

    @classmethod
    def not_distributed(cls, model, backend):
        """The error for a model no ``distribute()`` on ``backend`` (its name, as users write it) has seen."""
        return cls("Expected a model distributed with distkeras.distribute() on {}. Received: {!r} of type {}, which "
                   "is not.".format(backend, model, type(model).__name__))


class CheckpointError(DistKerasError, ValueError):
    """A checkpoint folder holds what distkeras didn't write or can't trust: a malformed manifest, a path outside
    the folder, a weights file whose checksum isn't the one written, an epoch beyond the run's."""


class NetworkError(DistKerasError, ConnectionError):
    """No interface reaches the coordinator, a named interface doesn't exist, or a host of the job is lost."""


class VerifyError(DistKerasError, AssertionError):
    """The one-device check (``distribute(..., verify=True)``, ``DISTKERAS_VERIFY=1``) found a distributed
    step that differs from the same step on one device."""


class CollectiveError(DistKerasError, RuntimeError):
    """A call every process of a job makes together (``predict()``, ``evaluate()``, ``save()``) wasn't made by
    every process in time, differed between them, or failed on the one that does the work."""


class DataError(DistKerasError, ValueError):
    """The data check (``distribute(..., check_data=True)``, the default in a job of several workers) found a
    worker whose input pipeline drew another global batch than rank 0's: an unseeded shuffle, files in another
    order, a dataset of another length, augmentation from unseeded ops."""
