"""Shared set-up of the backend suite, which runs once per Keras backend in its own process.

Test modules start with ``from tests.backends.harness import BACKEND, keras``: that skips the module
with a reason when the backend's framework is missing (never a silent pass), and splits the CPU into
virtual devices before Keras starts, so multi-device tests run without GPUs. :func:`replicated` runs a
test body where the backend keeps its replicas: in this process, or in worker processes for PyTorch.
"""

import atexit
import os

import pytest

from distkeras import backends

BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")
os.environ["KERAS_BACKEND"] = BACKEND
FRAMEWORKS = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}
#: Virtual CPU devices every backend test process gets.
CPU_DEVICES = 3

if BACKEND not in FRAMEWORKS or not backends.is_installed(FRAMEWORKS[BACKEND]):
    pytest.skip(
        "KERAS_BACKEND={}: {} is not installed here".format(BACKEND, FRAMEWORKS.get(BACKEND, BACKEND)),
        allow_module_level=True,
    )

import distkeras  # noqa: E402

distkeras.use_cpu_devices(CPU_DEVICES)

import keras  # noqa: E402

assert keras.backend.backend() == BACKEND, (keras.backend.backend(), BACKEND)

class BatchLogs(keras.callbacks.Callback):
    """The logs of every train and test batch, as a ``LossHistory`` callback of the keras-io guide keeps them."""

    def __init__(self):
        super().__init__()
        self.train, self.test = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.train.append(dict(logs))

    def on_test_batch_end(self, batch, logs=None):
        self.test.append(dict(logs))


#: Backends whose replicas are processes: their multi-device tests run in worker processes.
PROCESS_BACKENDS = ("torch",)
_jobs = {}


def job(size, local_size=None):
    """The worker processes of a ``size``-process job (started on first use, kept until the tests end)."""
    from tests.backends import workers

    key = (size, local_size or size)
    if key not in _jobs or not _jobs[key].alive:
        _jobs[key] = workers.Job(size, local_size)
    return _jobs[key]


def replicated(devices, fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` where ``distribute(model, devices=devices)`` has its replicas; rank 0's result.

    TensorFlow and JAX put replicas in this process, so ``fn`` runs here, as the test's own code would. On
    PyTorch each replica is a process: ``fn`` runs on every rank of a ``devices``-process job started the
    way a launcher starts one, and the result is rank 0's. ``fn`` must be a module-level function and
    return plain data (arrays, numbers, dicts, classes, exceptions).
    """
    if BACKEND not in PROCESS_BACKENDS:
        return fn(*args, **kwargs)
    return job(devices).run(fn, *args, **kwargs)[0].result


@atexit.register
def _close_jobs():
    for running in _jobs.values():
        running.close()
