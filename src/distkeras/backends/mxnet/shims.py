"""Shims that let keras-mxnet 2.2.4.3 (the last multi-backend Keras 2 for MXNet) run on today's Python and h5py.

keras-mxnet was released for Python 3.5-3.7 and h5py 2. ``import distkeras`` applies these shims when
the active Keras backend is ``"mxnet"`` or ``"cntk"`` (Keras 2.3.1, which on Python 3.6 needs only the
h5py one), so import distkeras *before* keras:

- Python 3.10 removed the ``collections.Iterable``-style aliases of ``collections.abc`` (keras'
  callbacks module imports ``from collections import Iterable``): they are put back.
- Python 3.11 removed ``inspect.getargspec`` (keras' ImageDataGenerator calls it): it is put back,
  built on ``inspect.getfullargspec``.
- h5py 3 stores a ``bytes`` attribute (or a list of them) as variable-length strings and reads them
  back as ``str`` (or an object array), on which Keras 2's ``load_model`` calls ``.decode()`` (or
  tests the array's truth) and fails. While the shim is on, h5py stores them as fixed-length strings,
  as h5py 2 did, so they read back as ``bytes`` and the files load in plain keras-mxnet on h5py 2 and
  3 alike.

Nothing here imports a framework, and nothing is changed for other backends. numpy's removed aliases
(``np.bool``, ``np.object``; numpy 1.24) are not shimmed: MXNet 1.9.1 needs ``numpy<1.24``. Part of the
Python 3.6-compatible core.
"""

import collections
import collections.abc
import inspect

from .. import when_imported

#: Keras 2 keeps HDF5 attributes below this size (``saving.HDF5_OBJECT_HEADER_LIMIT``); a larger
#: fixed-length attribute can't be written, so larger values keep h5py 3's variable-length form.
_HDF5_ATTRIBUTE_LIMIT = 64512

_ArgSpec = collections.namedtuple("ArgSpec", ["args", "varargs", "keywords", "defaults"])


def install():
    """Apply every shim (idempotent)."""
    restore_collections_aliases()
    restore_getargspec()
    when_imported("h5py", store_bytes_attributes_fixed_length)


def restore_collections_aliases():
    """Put back ``collections.Iterable`` and the other ABC aliases Python 3.10 removed."""
    for name in collections.abc.__all__:
        if name != "ByteString" and not hasattr(collections, name):  # ByteString: deprecated, unused
            setattr(collections, name, getattr(collections.abc, name))


def _getargspec(func):
    spec = inspect.getfullargspec(func)
    return _ArgSpec(spec.args, spec.varargs, spec.varkw, spec.defaults)


def restore_getargspec():
    """Put back ``inspect.getargspec``, removed in Python 3.11."""
    if not hasattr(inspect, "getargspec"):
        inspect.getargspec = _getargspec


def _h5py2_form(value, numpy):
    """``value`` as h5py 2 would have stored it: ``bytes`` and lists of ``bytes`` as fixed-length strings."""
    if type(value) is bytes:
        return numpy.bytes_(value) if 0 < len(value) < _HDF5_ATTRIBUTE_LIMIT else value
    if isinstance(value, (list, tuple)) and value and all(type(item) is bytes for item in value):
        array = numpy.array(value)
        return array if array.nbytes < _HDF5_ATTRIBUTE_LIMIT else value
    return value


def store_bytes_attributes_fixed_length():
    """Make h5py >= 3 store ``bytes`` attributes as fixed-length strings, as h5py 2 did (see the module doc)."""
    import h5py
    import numpy

    manager = h5py.AttributeManager
    if int(h5py.__version__.split(".")[0]) < 3 or getattr(manager.__setitem__, "_distkeras_shim", False):
        return
    original = manager.__setitem__

    def __setitem__(self, name, value):
        original(self, name, _h5py2_form(value, numpy))

    __setitem__._distkeras_shim = True
    manager.__setitem__ = __setitem__
