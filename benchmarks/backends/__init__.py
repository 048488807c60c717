"""Per-backend parts of the benchmark: one module per Keras backend, imported only in that backend's worker.

What is written once (variants a and b, timing, memory, reports) lives outside this package. A backend
module provides the rest:

``native(workload, devices) -> Variant``  (required)
    c: the data-parallel training a user would write by hand for this backend, without distkeras,
    as a :class:`benchmarks.variants.Variant` (``benchmarks.variants.fit_variant`` wraps a model).
``make_parallel(workload, devices) -> Variant``  (optional)
    d: the split-the-batch / replica-per-device / concatenate-the-outputs recipe. Absent: d is not
    run, and ``MISSING["make_parallel"]`` says why.
``copy_bandwidth(nbytes) -> float`` and ``allreduce_seconds(shapes, devices) -> [float]``  (optional)
    The communication microbenchmarks: bytes/s of a device-0 to device-1 copy, and the time of one
    all-reduce of arrays of the model's variable shapes over ``devices`` devices, by the mechanism the
    data-parallel step uses.
``device_peak_bytes(devices) -> list | None``  (optional)
    Peak accelerator memory per device since the process started (None where the backend has none).
``prepare(devices, options)``  (optional)
    Runs in the worker before Keras starts (TensorFlow: split one GPU into logical GPUs).
``fit_variant(key, model, devices, global_batch, marks)`` and ``set_random_seed(seed)``  (optional)
    For a Keras without ``PyDataset``, async callbacks or ``keras.utils.set_random_seed`` (keras-mxnet,
    Keras 2): how a, b (and the module's own variants) feed and time ``fit``, and how the worker seeds.

``setup_variant(key, workload, devices, build) -> Variant`` and ``reports() -> bool``  (optional)
    For a backend of one process per device (:data:`PROCESS_PER_DEVICE`): which of the job's processes
    set a variant up and train it (``build()`` sets it up), and whether this process writes the results.

Adding a backend is a module with ``native()`` and a line in :data:`PLANS`.
"""

import importlib

#: Keras backend -> the module holding its part of the benchmark.
PLANS = {
    "tensorflow": "benchmarks.backends.tensorflow",
    "jax": "benchmarks.backends.jax",
    "torch": "benchmarks.backends.torch",
    "mxnet": "benchmarks.backends.mxnet",
}

#: Backends whose N devices are N processes: their N-device workers run under ``distkeras launch``, except
#: for the variants one process runs alone (:data:`ONE_PROCESS`).
PROCESS_PER_DEVICE = ("torch",)
ONE_PROCESS = ("plain", "make_parallel")


def covered(backend):
    """True when the benchmark has a module for ``backend``."""
    return backend in PLANS


def get(backend):
    """The module of ``backend`` (imports its framework).

    Raises:
        KeyError: no module for ``backend`` yet.
    """
    return importlib.import_module(PLANS[backend])


def uncovered_reason(backend):
    """Why ``backend`` is not benchmarked, for the results' ``skipped`` list."""
    return "no benchmarks/backends module for {!r}; covered: {}".format(backend, ", ".join(PLANS))


def worker_command(python, backend, devices, variant=None):
    """The command line of a worker for ``devices`` devices (``variant``: a setup worker's variant)."""
    if backend in PROCESS_PER_DEVICE and devices > 1 and variant not in ONE_PROCESS:
        return [python, "-m", "distkeras", "launch", "--nproc-per-node", str(devices), "--backend", backend,
                "--stop-timeout", "10", "-m", "benchmarks.worker"]
    return [python, "-m", "benchmarks.worker"]
