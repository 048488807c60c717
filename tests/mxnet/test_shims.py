"""``import distkeras`` makes keras-mxnet 2.2.4.3 work on Python >= 3.10 and h5py 3, and touches nothing for
other backends. Each case runs in a fresh interpreter, since the shims act at import."""

import json
import subprocess
import sys

import numpy as np

from tests.mxnet.harness import keras  # noqa: F401 (skips without keras-mxnet)

_PROBE = """
import collections, inspect, json, sys
import distkeras
report = {"frameworks": sorted(m for m in ("keras", "mxnet", "h5py", "numpy") if m in sys.modules),
          "Iterable": hasattr(collections, "Iterable"), "getargspec": hasattr(inspect, "getargspec")}
if len(sys.argv) > 1:
    import h5py
    report["h5py_shim"] = getattr(h5py.AttributeManager.__setitem__, "_distkeras_shim", False)
if len(sys.argv) > 2:
    import keras
    report["backend"] = keras.backend.backend()
print(json.dumps(report))
"""


def probe(tmp_path, backend, *args):
    env = {"PATH": "", "KERAS_HOME": str(tmp_path / "keras-home")}  # an empty KERAS_HOME: no keras.json
    if backend:
        env["KERAS_BACKEND"] = backend
    done = subprocess.run(
        [sys.executable, "-c", _PROBE] + list(args),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, env=env, timeout=300, cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_distkeras_imports_no_framework_and_applies_the_shims(tmp_path):
    report = probe(tmp_path, "mxnet")
    assert report == {"frameworks": [], "Iterable": True, "getargspec": True}


def test_keras_mxnet_imports_after_distkeras_with_no_backend_named(tmp_path):
    # No KERAS_BACKEND and no keras.json: keras-mxnet's own default, "mxnet", is what distkeras detects.
    report = probe(tmp_path, None, "h5py", "keras")
    assert report["Iterable"] and report["getargspec"] and report["h5py_shim"]
    assert report["backend"] == "mxnet"


def test_no_shim_for_other_backends(tmp_path):
    report = probe(tmp_path, "tensorflow", "h5py")
    assert report["h5py_shim"] is False
    if sys.version_info >= (3, 10):
        assert report["Iterable"] is False
    if sys.version_info >= (3, 11):
        assert report["getargspec"] is False


def test_bytes_attributes_read_back_as_bytes(tmp_path):
    import h5py

    with h5py.File(str(tmp_path / "a.h5"), "w") as f:
        f.attrs["config"] = b'{"a": 1}'
    with h5py.File(str(tmp_path / "a.h5"), "r") as f:
        assert f.attrs["config"].decode("utf8") == '{"a": 1}'  # what Keras 2's load_model does


def test_plain_model_saved_in_a_distkeras_process_loads(tmp_path):
    model = keras.models.Sequential([keras.layers.Dense(2, input_shape=(3,))])
    model.compile(optimizer=keras.optimizers.SGD(lr=0.3, momentum=0.5), loss="mae")
    model.save(str(tmp_path / "m.h5"))
    loaded = keras.models.load_model(str(tmp_path / "m.h5"))
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
