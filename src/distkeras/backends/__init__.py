"""Backend registry: which Keras backend is active, and its adapter, imported only when asked for.

Nothing here imports a framework. The active backend is read, in order, from the model given (its
Keras package), from an already-imported ``keras``, from ``KERAS_BACKEND``, from Keras' config file
(``$KERAS_HOME/keras.json`` or ``~/.keras/keras.json``), else the installed Keras' default — the order
Keras itself uses. That default is ``"tensorflow"``, except for keras-mxnet (Keras 2.2.4.3), which
installs itself as ``keras`` and defaults to ``"mxnet"``. Keras 2.3.1, the last multi-backend Keras,
runs CNTK when ``KERAS_BACKEND`` or ``keras.json`` says ``"cntk"``; its models are ``keras.engine``
classes and report their backend through ``keras.backend.backend()``. Part of the Python 3.6-compatible core.
"""

import importlib
import importlib.abc
import importlib.util
import json
import os
import sys
from typing import Callable, Dict, Optional

from ..errors import BackendError, BackendUnavailableError

#: Keras backend name -> "module:Class" of its adapter. Each backend is one package, ``backends/<name>/``, whose
#: ``adapter`` module holds the adapter class and imports no framework (the launcher and ``distkeras info`` use its
#: class methods without one); the package's other modules are the backend's mechanism.
REGISTRY = {
    "tensorflow": "distkeras.backends.tensorflow.adapter:TensorFlowAdapter",
    "jax": "distkeras.backends.jax.adapter:JaxAdapter",
    "torch": "distkeras.backends.torch.adapter:TorchAdapter",
    "mxnet": "distkeras.backends.mxnet.adapter:MXNetAdapter",
    "cntk": "distkeras.backends.cntk.adapter:CNTKAdapter",
}

#: Backends Keras has that distkeras deliberately does not serve, and why.
UNSUPPORTED = {
    "numpy": "Keras' numpy backend runs inference only; it cannot train",
    "openvino": "Keras' openvino backend runs inference only; it cannot train",
    "theano": "Theano has been unmaintained since 2017 and has no multi-device training to build on",
}

#: Backends whose Keras needs shims before it is imported, applied by ``import distkeras``: "module:function".
SHIMS = {
    "mxnet": "distkeras.backends.mxnet.shims:install",
    "cntk": "distkeras.backends.mxnet.shims:install",  # the same multi-backend Keras 2 and h5py 3
}

_adapters: Dict[str, object] = {}


def is_installed(module: str) -> bool:
    """True when ``module`` can be imported (checked without importing it). The one place tests patch."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _check_name(name, where):
    if name in REGISTRY:
        return name
    if name in UNSUPPORTED:
        raise BackendError(
            "The Keras backend {!r} (from {}) is not supported by distkeras: {}. Supported backends: {}. "
            "Set KERAS_BACKEND to one of them.".format(name, where, UNSUPPORTED[name], ", ".join(REGISTRY))
        )
    raise BackendError(
        "Unknown Keras backend {!r} (from {}). Expected one of: {}. Set KERAS_BACKEND to one of them.".format(
            name, where, ", ".join(REGISTRY)
        )
    )


def _config_file_backend() -> Optional[str]:
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    path = os.path.join(home, "keras.json")
    try:
        with open(path) as handle:
            value = json.load(handle).get("backend")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def keras_package(model: object) -> Optional[str]:
    """The Keras package a model comes from: ``"keras"`` (Keras 3, or a multi-backend Keras 2 such as
    keras-mxnet, whose models are ``keras.engine`` classes) or ``"tf_keras"``; None if it is no Keras model."""
    for cls in type(model).__mro__:
        root = cls.__module__.split(".")[0]
        if root in ("keras", "tf_keras") and cls.__name__ in ("Model", "Functional", "Sequential", "Layer"):
            return root
    return None


def _installed_keras_default() -> str:
    """The backend the installed ``keras`` uses when nothing names one, found without importing it."""
    try:
        spec = importlib.util.find_spec("keras")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        if os.path.exists(os.path.join(os.path.dirname(spec.origin), "backend", "mxnet_backend.py")):
            return "mxnet"  # keras-mxnet
    return "tensorflow"


def active_name(model: object = None) -> str:
    """The name of the Keras backend in use (validated against :data:`REGISTRY`).

    Raises:
        BackendError: the backend is unknown, or known to Keras but not served by distkeras.
    """
    package = keras_package(model) if model is not None else None
    if package == "tf_keras":
        return "tensorflow"
    if package is None and model is None and "keras" in sys.modules:
        package = "keras"
    if package == "keras" and hasattr(sys.modules.get("keras"), "backend"):
        return _check_name(sys.modules["keras"].backend.backend(), "keras.backend.backend()")
    if os.environ.get("KERAS_BACKEND"):
        return _check_name(os.environ["KERAS_BACKEND"], "KERAS_BACKEND")
    configured = _config_file_backend()
    if configured:
        return _check_name(configured, "keras.json")
    return _installed_keras_default()


def active_source() -> str:
    """Where :func:`active_name` (without a model) finds the backend: "keras.backend.backend()" once Keras is
    imported, else "KERAS_BACKEND", "keras.json", or "the default" (Keras' own, read without importing it)."""
    if hasattr(sys.modules.get("keras"), "backend"):
        return "keras.backend.backend()"
    if os.environ.get("KERAS_BACKEND"):
        return "KERAS_BACKEND"
    return "keras.json" if _config_file_backend() else "the default"


def loaded():
    """The adapters created so far in this process (those that may have started something to stop)."""
    return list(_adapters.values())


def adapter_class(name):
    """The adapter class of backend ``name``, imported without its framework (for class methods such as the
    launcher's :meth:`~distkeras.backends.base.Adapter.workers_env`).

    Raises:
        BackendError: ``name`` is not a supported backend.
    """
    _check_name(name, "the caller")
    module_name, _, class_name = REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def install_shims() -> None:
    """Apply the shims of the active backend's Keras, if it has any (:data:`SHIMS`); called by ``import distkeras``."""
    try:
        name = active_name()
    except BackendError:  # distribute() reports it, with the full message
        return
    if name in SHIMS:
        module_name, _, function = SHIMS[name].partition(":")
        getattr(importlib.import_module(module_name), function)()


def get(name):
    """The adapter for backend ``name``, importing its module on first use.

    Raises:
        BackendError: ``name`` is not a supported backend.
        BackendUnavailableError: the backend's framework is not installed.
    """
    _check_name(name, "the caller")
    if name not in _adapters:
        cls = adapter_class(name)
        if not is_installed(cls.framework):
            raise BackendUnavailableError(
                "The Keras backend is {!r}, but {} is not installed. Install it with `pip install {}`, or set "
                "KERAS_BACKEND to an installed backend.".format(name, cls.framework, cls.install_hint)
            )
        _adapters[name] = cls()
    return _adapters[name]


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs a callback right after a module finishes importing (a one-shot post-import hook)."""

    def __init__(self, name, callback):
        self.name = name
        self.callback = callback
        self.inner = None

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or self.inner is not None:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self.inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        module.__spec__.loader = self.inner
        module.__loader__ = self.inner
        self.inner.exec_module(module)
        self.callback()


def when_imported(module: str, callback: Callable[[], None]) -> None:
    """Call ``callback()`` once ``module`` is imported: now if it already is, else right after its import."""
    if module in sys.modules:
        callback()
        return
    sys.meta_path.insert(0, _AfterImport(module, callback))
