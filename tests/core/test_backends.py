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


@pytest.mark.parametrize("name", sorted(backends.REGISTRY))
def test_a_misspelt_option_says_did_you_mean(name):
    """``distribute(model, compresion="bf16")``: the name, the closest option, then the valid names, briefly."""
    adapter = backends.adapter_class(name)()
    with pytest.raises(OptionError) as info:
        adapter.check_options({"compresion": "bf16"})
    message = str(info.value)
    assert message.startswith("compresion: did you mean 'compression'? The {} backend's options: ".format(name))
    assert ", ".join(sorted(adapter.options)) in message and len(message) < 400, message
    with pytest.raises(OptionError, match=r"^verfy: did you mean 'verify'\? zzz: no such option\. The "):
        adapter.check_options({"verfy": True, "zzz": 1})  # distribute()'s own options are suggested too


def test_backend_source(clean_env, monkeypatch):
    assert backends.active_source() == "the default"
    (clean_env / "keras.json").write_text(json.dumps({"backend": "jax"}))
    assert backends.active_source() == "keras.json"
    monkeypatch.setenv("KERAS_BACKEND", "torch")
    assert backends.active_source() == "KERAS_BACKEND"


def test_non_keras_model_is_refused():
    with pytest.raises(distkeras.ModelError, match="Expected a Keras model"):
        distkeras.distribute([1, 2, 3])


def _keras_class(name, module, *bases):
    return type(name, bases or (object,), {"__module__": module, "__repr__": lambda self: "<{}>".format(name)})


def test_a_layer_is_refused_as_no_model_on_keras_2_and_3_alike():
    # distribute(keras.layers.Dense(2)) failed later, deep in fit(), with "AttributeError: ... compute_loss". The
    # check reads class names only (no keras import): Keras 3's classes and Keras 2's (keras-mxnet, CNTK) alike.
    from distkeras import api

    for layer_module, model_module in (("keras.src.layers.layer", "keras.src.models.model"),
                                       ("keras.engine.base_layer", "keras.engine.training"),
                                       ("tf_keras.src.engine.base_layer", "tf_keras.src.engine.training")):
        layer = _keras_class("Layer", layer_module)
        dense = _keras_class("Dense", layer_module.rpartition(".")[0] + ".core", layer)
        model = _keras_class("Model", model_module, layer)
        sequential = _keras_class("Sequential", model_module.rpartition(".")[0] + ".sequential", model)
        with pytest.raises(distkeras.ModelTypeError) as info:
            distkeras.distribute(dense(), devices=2)
        assert isinstance(info.value, TypeError) and isinstance(info.value, distkeras.ModelError)
        assert "Expected a Keras model" in str(info.value)
        assert "Received: <Dense> of type Dense, a Keras layer, not a model" in str(info.value)
        assert "keras.Sequential([keras.Input(shape=...), layer])" in str(info.value)
        api._check_model(sequential())  # no error: a model
        api._check_model(model())
    with pytest.raises(distkeras.ModelTypeError, match=r"Received: \[1\] of type list, which is no Keras model"):
        distkeras.distribute([1])


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


# ---- describe()'s "workers" and "replicas": one meaning on every backend (fake clusters, no framework)


def _cluster(world, local, rank=0):
    from distkeras.cluster import Cluster

    return Cluster(rank=rank, world_size=world, local_rank=rank % local, local_world_size=local,
                   coordinator=None if world == 1 else "127.0.0.1:29500", source="single" if world == 1 else "torchrun")


def _devices(n):
    from distkeras.devices import Device

    return [Device("cpu", i) for i in range(n)]


@pytest.mark.parametrize(
    "world,local,devices,replicas",
    [
        (1, 1, 2, 2),  # one process, two devices
        (2, 2, 1, 2),  # two processes on one host, one device each
        (4, 2, 2, 8),  # two hosts of two processes, two devices each
    ],
)
def test_by_default_every_process_drives_its_devices(world, local, devices, replicas):
    assert _Toy().replicas(_devices(devices), _cluster(world, local)) == replicas


@pytest.mark.parametrize(
    "world,local,devices,replicas",
    [
        (1, 1, 2, 2),  # a plain process asking for 2 devices: it starts a job of 2 processes
        (2, 2, 2, 2),  # that job, or one launched with --nproc-per-node 2
        (4, 2, 2, 4),  # two hosts of two processes
    ],
)
def test_on_torch_the_replicas_are_the_processes(world, local, devices, replicas):
    from distkeras.backends.torch.adapter import TorchAdapter  # imports no torch

    assert TorchAdapter().replicas(_devices(devices), _cluster(world, local)) == replicas


def test_cntk_runs_one_device_per_process():
    from distkeras.backends.cntk.adapter import CNTKAdapter  # imports no cntk

    assert CNTKAdapter().replicas(_devices(1), _cluster(3, 3)) == 3


class _Model(object):
    built = True


class _SelfLaunching(_Toy):
    """Like PyTorch in a plain process: distribute() makes it rank 0 of a job, through os.environ."""

    def list_devices(self):
        return _devices(2)

    def distribute(self, model, devices, cluster, **options):
        assert not cluster.is_multi_worker
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(len(devices)), LOCAL_WORLD_SIZE=str(len(devices)),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
        return model

    def replicas(self, devices, cluster):
        from distkeras.backends.torch.adapter import TorchAdapter

        return TorchAdapter.replicas(self, devices, cluster)


_LAUNCHER_PREFIXES = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TF_CONFIG", "JAX_", "KERAS_DISTRIBUTION_", "OMPI_",
                      "PMI_", "MPI_", "DISTKERAS_")


@pytest.fixture
def no_launcher(monkeypatch):
    """No launcher variables; whatever the test sets (distribute() included) is removed after it."""
    for name in list(os.environ):
        if name.startswith(_LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # recorded as absent, so restored as absent
        monkeypatch.delenv(name)


def test_workers_are_the_processes_of_the_job_distribute_made(monkeypatch, no_launcher):
    from distkeras import api

    model = _Model()
    monkeypatch.setattr(api, "_adapter_for", lambda m: _SelfLaunching())
    assert distkeras.distribute(model, devices=2) is model
    info = distkeras.describe(model)
    assert (info["workers"], info["replicas"], info["rank"], info["devices"]) == (2, 2, 0, ["cpu:0", "cpu:1"])


@pytest.mark.parametrize("world,local,devices,replicas", [(1, 1, 2, 2), (2, 1, 2, 4), (2, 2, 1, 2)])
def test_workers_are_the_processes_on_every_adapter(world, local, devices, replicas):
    from distkeras import api

    info = api._record(_Model(), _Toy(), _devices(devices), _cluster(world, local), distributed=True)
    assert (info["workers"], info["replicas"]) == (world, replicas)


def test_global_batch_size_counts_the_replicas_as_describe_does(monkeypatch, no_launcher):
    monkeypatch.setattr(backends, "get", lambda name: _SelfLaunching())
    assert distkeras.global_batch_size(32, devices=2) == 64
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    for name, value in (("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    assert distkeras.global_batch_size(32, devices=2) == 128  # two hosts of two processes


def test_the_jax_adapter_documents_the_multi_process_support_it_implements():
    """The JAX adapter starts jax.distributed and lays a model out over every process' devices; its docstrings say
    so, and none says multi-process is missing (read from the source: the module imports no framework)."""
    import ast
    import inspect

    from distkeras.backends.jax import adapter

    source = inspect.getsource(adapter)
    docstrings = [ast.get_docstring(node) or "" for node in ast.walk(ast.parse(source))
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))]
    assert "jax.distributed" in adapter.__doc__ and "Across processes" in adapter.__doc__
    distribute = inspect.getdoc(adapter.JaxAdapter.distribute)
    assert "jax.distributed" in distribute and "TooLateError" in distribute
    for text in docstrings:
        lowered = " ".join(text.lower().split())
        assert "not implemented" not in lowered and "one process only" not in lowered, text


# ---- describe()'s "shard": None or the mode, on every backend (the adapter reads it off the model)


class _ShardingToy(_Toy):
    def shard_mode(self, model):
        return model.mode


@pytest.mark.parametrize("mode", [None, "optimizer", "all"])
def test_describe_reports_the_shard_mode(mode):
    from distkeras import api

    model = _Model()
    model.mode = mode
    assert api._record(model, _ShardingToy(), _devices(2), _cluster(2, 2), distributed=True)["shard"] == mode
    assert api._record(model, _ShardingToy(), _devices(1), _cluster(1, 1), distributed=False)["shard"] is None
    # The default adapter (a backend that can't shard) reports None.
    assert api._record(model, _Toy(), _devices(2), _cluster(2, 2), distributed=True)["shard"] is None


def test_torch_and_jax_adapters_read_the_mode_their_distribute_sets():
    from distkeras.backends.jax import adapter as jax_adapter  # imports no jax
    from distkeras.backends.torch.adapter import TorchAdapter  # imports no torch

    class Sharding(object):
        mode = "gradients"

    torch_model, jax_model = _Model(), _Model()
    assert TorchAdapter().shard_mode(torch_model) is None and jax_adapter.JaxAdapter().shard_mode(jax_model) is None
    torch_model._distkeras_sharding = Sharding()  # torch's shard._SHARDING
    jax_model.__dict__[jax_adapter._SHARD_MODE] = "all"
    assert TorchAdapter().shard_mode(torch_model) == "gradients" and jax_adapter.JaxAdapter().shard_mode(jax_model) == "all"
