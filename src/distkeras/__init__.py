"""distkeras: train a Keras model on many devices and many machines with one unchanged call.

    model = distkeras.distribute(model, devices=4)

Importing distkeras imports no deep-learning framework; the active backend's adapter is loaded the
first time it is needed. With keras-mxnet (Keras 2), import distkeras before keras: the import applies
the shims keras-mxnet needs on Python >= 3.10 (see :mod:`distkeras.backends.mxnet.shims`). Part of the Python
3.6-compatible core.
"""

from .api import describe, distribute, global_batch_size, shutdown, use_cpu_devices
from .cluster import Cluster
from .devices import Device
from .errors import (
    BackendError,
    BackendUnavailableError,
    CheckpointError,
    ClusterError,
    CollectiveError,
    DataError,
    DeviceSpecError,
    DistKerasError,
    LaunchError,
    LoopError,
    ModelError,
    ModelTypeError,
    NetworkError,
    OptionError,
    ShardError,
    TooLateError,
    VerifyError,
)
from .loops import attach, distribute_dataset, distribute_step
from .ranks import is_main_process, local_rank, local_size, print0, rank, size
from .sharding import shard, shard_bounds

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "BackendUnavailableError",
    "CheckpointError",
    "Cluster",
    "ClusterError",
    "CollectiveError",
    "DataError",
    "Device",
    "DeviceSpecError",
    "DistKerasError",
    "LaunchError",
    "LoopError",
    "ModelError",
    "ModelTypeError",
    "NetworkError",
    "OptionError",
    "ShardError",
    "TooLateError",
    "VerifyError",
    "attach",
    "describe",
    "distribute",
    "distribute_dataset",
    "distribute_step",
    "global_batch_size",
    "is_main_process",
    "local_rank",
    "local_size",
    "print0",
    "rank",
    "shard",
    "shard_bounds",
    "shutdown",
    "size",
    "use_cpu_devices",
]

import sys as _sys  # noqa: E402

from . import api as _api  # noqa: E402
from . import backends as _backends  # noqa: E402
from . import worker as _worker  # noqa: E402

from .parallel import layouts  # noqa: E402

# A public module that moved keeps its old name: the same module object under both (an import, an attribute, a
# monkeypatch all reach the one module). distkeras.layouts is named in the docs; it lives in distkeras.parallel.
_sys.modules[__name__ + ".layouts"] = layouts

_backends.install_shims()
_api.install_log_handler()
_api.apply_env_cpu_devices()
_worker.prepare_multi_worker()
