"""Where Keras 3 draws the global batch, for the data check (:mod:`distkeras.verify.datacheck`), written once for every
Keras 3 backend.

Keras' ``fit``/``evaluate``/``predict`` (and fit's validation) read the data through an ``EpochIterator``
(``keras/src/trainers/epoch_iterator.py``, the base class of ``TFEpochIterator``, ``JAXEpochIterator`` and
``TorchEpochIterator``): its ``__init__`` makes the data adapter that yields the global batches, and its
``_enumerate_iterator`` generator starts each epoch and hands out the steps. There is no public hook, so both are
wrapped once on that base class (a Keras private; guarded, pinned by a test). The wrappers change nothing unless a
distributed model's call is running in this thread with a :class:`~distkeras.verify.datacheck.Watch` (:func:`hook`):

- ``__init__`` lets the backend wrap the new data adapter (``watch.wrap_adapter``), which notes the first batch of
  every pass over the data as this worker drew it, before its share is taken;
- ``_enumerate_iterator``, once the epoch's first step has run, has every worker compare what it noted
  (:meth:`Watch.check`): every worker reaches that point in the same step of the same call.
"""

import functools
import logging
import threading

from . import keras_model

logger = logging.getLogger("distkeras")

#: The Watch of the distributed call running in this thread.
_active = threading.local()
_PRIVATE_MODULE = "keras.src.trainers.epoch_iterator"
_PRIVATE_CLASS = "EpochIterator"
_WATCH = "_distkeras_watch"
#: The model's instance attribute holding its Watch.
WATCH_OF_MODEL = "_distkeras_data_watch"


def current():
    """The :class:`~distkeras.verify.datacheck.Watch` of the distributed call running in this thread, or None."""
    return getattr(_active, "watch", None)


def _epoch_iterator_class():
    import importlib

    try:
        return getattr(importlib.import_module(_PRIVATE_MODULE), _PRIVATE_CLASS)
    except (ImportError, AttributeError):
        return None


def install():
    """Wrap ``EpochIterator.__init__`` and ``_enumerate_iterator`` once (idempotent). Returns False where this
    Keras has no such class (the check is then off, said once)."""
    base = _epoch_iterator_class()
    if base is None or not hasattr(base, "_enumerate_iterator"):
        return False
    if getattr(base.__init__, "distkeras", False):
        return True
    init, enumerate_iterator = base.__init__, base._enumerate_iterator

    @functools.wraps(init)
    def watched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        watch = current()
        self.__dict__[_WATCH] = watch
        if watch is not None:
            self.__dict__["_distkeras_where"] = watch.call
            if watch.wrap_adapter is not None:
                watch.wrap_adapter(self.data_adapter, self)

    @functools.wraps(enumerate_iterator)
    def watched_enumerate(self):
        watch = self.__dict__.get(_WATCH)
        steps = enumerate_iterator(self)
        if watch is None:
            yield from steps
            return
        first = True
        for item in steps:
            yield item
            if first:
                first = False
                _check(watch, self)
        if first:  # an epoch without a step: the workers still meet once
            _check(watch, self)

    watched_init.distkeras = True
    base.__init__, base._enumerate_iterator = watched_init, watched_enumerate
    return True


def _check(watch, iterator):
    """Every worker compares its batch after the first step of an epoch of ``iterator``'s call."""
    epoch = iterator.__dict__["_distkeras_epochs"] = iterator.__dict__.get("_distkeras_epochs", 0) + 1
    call = iterator.__dict__.get("_distkeras_where", "fit")
    where = "{}(){}".format(call, ", epoch {}".format(epoch) if call == "fit" or epoch > 1 else "")
    watch.check(where, read=(lambda: watch.read(iterator)) if watch.read is not None else None)


def hook(model, watch):
    """Run ``model``'s ``fit``/``evaluate``/``predict`` with ``watch`` active in their thread (instance hooks, over
    whatever hooks the adapter set before)."""
    if not install():
        logger.warning("the data check is off: this Keras reads its data without keras.src.trainers.epoch_iterator."
                       "EpochIterator, where distkeras sees each worker's global batch")
        return
    keras_model.hook(model, WATCH_OF_MODEL, watch)
    for name in ("fit", "evaluate", "predict"):
        method = getattr(model, name)

        @functools.wraps(method)
        def call(*args, _method=method, _name=name, **kwargs):
            outer, outer_call = current(), watch.call
            _active.watch, watch.call = watch, _name
            try:
                return _method(*args, **kwargs)
            finally:
                _active.watch, watch.call = outer, outer_call

        keras_model.hook(model, name, call)


def numpy_parts(batch):
    """The :class:`~distkeras.verify.datacheck.Part` of every array in a batch of NumPy-convertible leaves (NumPy, JAX,
    torch tensors: a CUDA one is copied to the host), named by their place in ``(x, y, sample_weight)``."""
    import keras

    from ..verify import datacheck

    parts = []
    for path, leaf in keras.tree.flatten_with_path(batch):
        if leaf is None:
            continue
        if hasattr(leaf, "detach"):  # a torch tensor
            leaf = leaf.detach().cpu().numpy()
        part = datacheck.digest_array(leaf)
        parts.append(part._replace(name=datacheck.part_name(path)))
    return parts


class NotedPasses(object):
    """An iterable of batches (a data loader) whose every pass notes its first batch: ``note(batch)``. A backend
    that reads the batches its own way (PyTorch's rows ``[rank::world]``) takes ``batches``, ``note`` and ``first``
    (a one-item list, True until the pass' first batch is noted) and notes where it sees the whole batch."""

    def __init__(self, batches, note):
        self.batches, self.note, self.first = batches, note, [True]

    def __iter__(self):
        # The loader's iterator is made now, as Keras makes it (a torch DataLoader draws its seed and order from the
        # global generator then; Keras makes the next epoch's at the end of this one, before the validation).
        self.first[0] = True
        return self._noted(iter(self.batches))

    def _noted(self, batches):
        for batch in batches:
            if self.first[0]:
                self.first[0] = False
                self.note(batch)
            yield batch

    def __len__(self):
        return len(self.batches)


def noting_adapter(getter):
    """A ``wrap_adapter`` for :class:`~distkeras.verify.datacheck.Watch` on a backend whose data adapter yields NumPy-
    convertible batches: the adapter's ``getter`` (``get_jax_iterator``, ``get_torch_dataloader``) returns
    :class:`NotedPasses` that note each pass' first batch with :func:`numpy_parts`."""

    def wrap_adapter(adapter, iterator):
        original = getattr(adapter, getter)
        watch = iterator.__dict__[_WATCH]

        def note(batch):
            watch.note(numpy_parts(batch), adapter.num_batches)

        setattr(adapter, getter, lambda: NotedPasses(original(), note))

    return wrap_adapter
