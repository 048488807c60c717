"""Shared set-up of the MXNet suite (keras-mxnet 2.2.4.3, Keras 2), run in its own virtual environment.

Test modules start with ``from tests.mxnet.harness import keras``: that skips the module with a reason
when keras-mxnet isn't the installed ``keras`` (the Keras 3 environments), and otherwise imports
distkeras *before* keras — which applies the shims keras-mxnet needs on Python >= 3.10 — with three
CPU contexts, so multi-device tests run without GPUs.
"""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: CPU contexts every test process gets.
CPU_DEVICES = 3


def keras_mxnet_installed():
    """True when ``keras`` is keras-mxnet and mxnet is installed (checked without importing either)."""
    spec = importlib.util.find_spec("keras")
    if spec is None or not spec.origin or importlib.util.find_spec("mxnet") is None:
        return False
    return os.path.exists(os.path.join(os.path.dirname(spec.origin), "backend", "mxnet_backend.py"))


if not keras_mxnet_installed():
    pytest.skip(
        "keras-mxnet 2.2.4.3 and mxnet are not installed in this environment (scripts/mxnet-env.sh makes one)",
        allow_module_level=True,
    )

os.environ["KERAS_BACKEND"] = "mxnet"
# keras-mxnet writes keras.json with "mxnet" into KERAS_HOME when there is none; keep it out of ~/.keras.
os.environ.setdefault("KERAS_HOME", os.path.join(ROOT, ".keras-home-mxnet"))

import distkeras  # noqa: E402  (before keras: it applies the shims)

distkeras.use_cpu_devices(CPU_DEVICES)

import keras  # noqa: E402  (installed but failing to import is a failure, not a skip)

assert keras.backend.backend() == "mxnet", keras.backend.backend()
