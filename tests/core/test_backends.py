"""Backend resolution and the registry, without importing any framework."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import distkeras
from distkeras import BackendError, BackendUnavailableError, OptionError, backends
from distkeras.backends.base import Adapter

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    monkeypatch.delitem(sys.modules, "keras", raising=False)
    return tmp_path


def test_default_is_tensorflow(clean_env):
    assert backends.active_name() == "tensorflow"


def test_keras_backend_variable_wins_over_keras_json(clean_env, monkeypatch):
    (clean_env / "keras.json").write_text(json.dumps({"backend": "torch"}))
    assert backends.active_name() == "torch"
    monkeypatch.setenv("KERAS_BACKEND", "jax")
    assert backends.active_name() == "jax"


def test_unknown_keras_backend(clean_env, monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "tensorflo")
    with pytest.raises(BackendError, match=r"Unknown Keras backend 'tensorflo' \(from KERAS_BACKEND\). Expected one of: "
                                           r"tensorflow, jax, torch, mxnet, cntk"):
        backends.active_name()


@pytest.mark.parametrize("name", ["numpy", "openvino", "theano"])
def test_backends_keras_has_but_distkeras_does_not_serve(clean_env, monkeypatch, name):
    monkeypatch.setenv("KERAS_BACKEND", name)
    with pytest.raises(BackendError, match="not supported by distkeras"):
        backends.active_name()


def test_missing_framework_is_an_import_error(monkeypatch):
    monkeypatch.setattr(backends, "is_installed", lambda module: False)
    monkeypatch.setattr(backends, "_adapters", {})
    with pytest.raises(BackendUnavailableError, match=r"'tensorflow', but tensorflow is not installed. Install it with `pip install tensorflow"):
        backends.get("tensorflow")
    with pytest.raises(ImportError):
        backends.get("tensorflow")


def test_every_registered_adapter_module_exists_and_implements_the_interface():
    import importlib

    for name, target in backends.REGISTRY.items():
        module_name, _, class_name = target.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except ImportError as exc:
            pytest.fail("{} adapter {} does not import without its framework: {}".format(name, target, exc))
        assert issubclass(cls, Adapter) and cls.name == name


class _Toy(Adapter):
    name = "toy"
    options = {"alpha": "a knob"}

    def list_devices(self):
        return []

    def set_cpu_devices(self, count):
        pass

    def distribute(self, model, devices, cluster, **options):
        return model


def test_unknown_options_name_the_known_ones():
    with pytest.raises(OptionError, match=r"Unknown option\(s\) beta for the toy backend. Options it accepts: alpha \(a knob\)"):
        _Toy().check_options({"beta": 1})
    _Toy().check_options({"alpha": 1})


def test_non_keras_model_is_refused():
    with pytest.raises(distkeras.ModelError, match="Expected a Keras model"):
        distkeras.distribute([1, 2, 3])


def test_when_imported_runs_after_the_module_is_imported(tmp_path):
    (tmp_path / "fakefw.py").write_text("VALUE = 41\n")
    script = textwrap.dedent("""
        import sys
        sys.path[:0] = [{src!r}, {tmp!r}]
        from distkeras import backends
        seen = []
        backends.when_imported("fakefw", lambda: seen.append(sys.modules["fakefw"].VALUE + 1))
        assert seen == []
        import fakefw
        assert seen == [42], seen
        assert fakefw.__spec__.loader.__class__.__name__ != "_AfterImport"
        backends.when_imported("fakefw", lambda: seen.append("again"))
        assert seen == [42, "again"]
        print("ok")
    """).format(src=SRC, tmp=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch", "mxnet", "cntk"])
def test_import_distkeras_imports_no_framework(backend, tmp_path):
    script = textwrap.dedent("""
        import sys, time
        sys.path.insert(0, {src!r})
        started = time.perf_counter()
        import distkeras
        elapsed = time.perf_counter() - started
        heavy = sorted(m for m in ("tensorflow", "jax", "torch", "mxnet", "cntk", "keras", "numpy") if m in sys.modules)
        print(heavy, elapsed)
    """).format(src=SRC)
    env = dict(os.environ, KERAS_BACKEND=backend, KERAS_HOME=str(tmp_path), DISTKERAS_CPU_DEVICES="2")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    heavy, _ = done.stdout.rsplit(" ", 1)
    assert heavy == "[]", "import distkeras imported {} with KERAS_BACKEND={}".format(heavy, backend)


def test_shutdown_asks_the_adapters_in_use_and_starts_none(monkeypatch):
    stopped = []

    class _Stopping(_Toy):
        def shutdown(self):
            stopped.append(self)

    quiet, stopping = _Toy(), _Stopping()
    monkeypatch.setattr(backends, "_adapters", {"quiet": quiet, "stopping": stopping})
    monkeypatch.setattr(backends, "get", lambda name: pytest.fail("shutdown() must not load an adapter"))
    distkeras.shutdown()
    assert stopped == [stopping]
    assert "shutdown" in distkeras.__all__
