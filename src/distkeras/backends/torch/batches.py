"""Each replica's rows of the global batch, read where Keras reads the data: ``fit``/``evaluate``'s epoch iterator
and the DataLoader Keras makes, sliced before Keras converts (copies) them (:func:`sharded_batches`).

Used by :mod:`~distkeras.backends.torch.trainer`'s entry points; its module docstring has the rules.
"""

import contextlib
import functools
import importlib
import threading

import keras
import torch

from .. import datawatch


#: Keras' torch trainer module and the epoch iterator class its fit() and evaluate() look up in it (privates).
_PRIVATE_TRAINER_MODULE = "keras.src.backend.torch.trainer"

_PRIVATE_EPOCH_ITERATOR = "TorchEpochIterator"



#: The replica whose fit()/evaluate() is in flight in this thread (None: Keras' own behaviour).
_reading = threading.local()



@functools.lru_cache(maxsize=None)
def _epoch_iterator_class(base):
    """A subclass of Keras' ``TorchEpochIterator`` ``base`` whose data loader, while a distributed
    ``fit``/``evaluate`` runs in this thread, reads or converts only this rank's rows of each global batch
    (:func:`_sharded_loader`)."""
    if getattr(base, "_distkeras_sharded", False):
        return base

    class ShardedEpochIterator(base):
        _distkeras_sharded = True

        def _get_iterator(self):
            loader = super()._get_iterator()
            replica = getattr(_reading, "replica", None)
            return loader if replica is None else _sharded_loader(loader, replica)

    ShardedEpochIterator.__name__ = ShardedEpochIterator.__qualname__ = base.__name__
    ShardedEpochIterator.__module__ = base.__module__
    return ShardedEpochIterator



#: The datasets of the loaders Keras' data adapters make (privates, defined inside those functions):
#: arrays (ArrayDataAdapter: indices in, converted rows out) and batches an iterable yields, converted one by
#: one (PyDataset, generators, tf.data: ``data_adapter_utils.get_torch_dataloader``).
_PRIVATE_DATASETS = ("ArrayDataset", "ConverterIterableDataset")



def _sharded_loader(loader, replica):
    """The loader Keras made for a fit()/evaluate(), reading or converting only this rank's rows.

    - Arrays: each batch's ``__getitems__(indices)`` (the global batch's indices, in the order one process
      draws them) reads ``indices[rank::world]`` only (the first index alone where that is empty: a
      stand-in).
    - Batches an iterable yields (a PyDataset, a generator): each whole batch is sliced ``[rank::world]``
      (:meth:`Replica.rows_of`) before Keras' ``convert_to_tensor`` copies it, instead of after.

    Each batch is noted in ``replica.read`` with its count and the global batch's. Any other loader (a
    DataLoader the user passed, whose batches are tensors already) is returned as it is: its whole batches
    are sliced in the step."""
    noted = loader if isinstance(loader, datawatch.NotedPasses) else None  # the data check's (noting first batches)
    loader = noted.batches if noted is not None else loader
    dataset = getattr(loader, "dataset", None)
    kind = type(dataset).__name__ if type(dataset).__module__.startswith("keras.") else None
    if not isinstance(loader, torch.utils.data.DataLoader) or kind not in _PRIVATE_DATASETS:
        return loader if noted is None else noted
    first = noted.first if noted is not None else [False]
    if kind == "ArrayDataset":

        class ShardedDataset(torch.utils.data.Dataset):
            def __getitems__(self, indices):
                if noted is not None and first[0]:  # the data check: the whole global batch, once a pass
                    first[0] = False
                    noted.note(dataset.__getitems__(list(indices)))
                local = list(indices)[replica.rank :: replica.world]
                rows = dataset.__getitems__(local or list(indices)[:1])
                replica.read.append((rows, len(local), len(indices)))
                return rows

            def __len__(self):
                return len(dataset)

        return _Passes(torch.utils.data.DataLoader(ShardedDataset(), batch_sampler=loader.batch_sampler,
                                                   collate_fn=loader.collate_fn), replica, first)
    class ShardedBatches(torch.utils.data.IterableDataset):
        def __iter__(self):
            for batch in dataset.iterable:
                if noted is not None and first[0]:  # the data check: the whole global batch, once a pass
                    first[0] = False
                    noted.note(batch)
                rows, count, total = replica.rows_of(batch)
                # What Keras' loader yields: converted (by the backend's convert_to_tensor, which keras.ops'
                # calls), then (batch_size=None) torch's default_convert.
                rows = torch.utils.data.default_convert(
                    keras.tree.map_structure(keras.ops.convert_to_tensor, rows, none_is_leaf=False))
                replica.read.append((rows, count, total))
                yield rows

    return _Passes(torch.utils.data.DataLoader(ShardedBatches(), batch_size=None, collate_fn=_as_is), replica, first)



def _as_is(batch):
    return batch



class _Passes(object):
    """A sharded loader: each pass over it starts with ``replica.read`` empty (a pass Keras broke off, as
    fit() does after one batch to build the metrics, leaves none of its batches behind)."""

    def __init__(self, loader, replica, first):
        self.loader, self.replica, self.first = loader, replica, first

    def __iter__(self):
        self.replica.read.clear()
        self.first[0] = True  # the data check notes this pass' first batch (where it is on)
        return iter(self.loader)

    def __len__(self):
        return len(self.loader)



@contextlib.contextmanager
def sharded_batches(replica):
    """While it is open, this thread's ``fit()``/``evaluate()`` on array data read only ``replica``'s rows of
    each global batch instead of every row (then sliced): Keras' torch trainer module names
    ``TorchEpochIterator`` when a call starts, so the module's name is pointed at a subclass
    (:func:`_epoch_iterator_class`, which changes nothing in other threads or outside this block) and put
    back when the block closes."""
    module = importlib.import_module(_PRIVATE_TRAINER_MODULE)
    original = getattr(module, _PRIVATE_EPOCH_ITERATOR)
    outer = getattr(_reading, "replica", None)
    setattr(module, _PRIVATE_EPOCH_ITERATOR, _epoch_iterator_class(original))
    _reading.replica = replica
    try:
        yield
    finally:
        _reading.replica = outer
        setattr(module, _PRIVATE_EPOCH_ITERATOR, original)
