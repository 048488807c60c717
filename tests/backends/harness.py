"""Shared set-up of the backend suite, which runs once per Keras backend in its own process.

Test modules start with ``from tests.backends.harness import BACKEND, keras``: that skips the module
with a reason when the backend's framework is missing (never a silent pass), and splits the CPU into
virtual devices before Keras starts, so multi-device tests run without GPUs.
"""

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
