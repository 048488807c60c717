"""PyTorch's primitives of the one-device check (:mod:`distkeras.verify`).

Keras' torch step function takes ``[batch]`` (``keras/src/backend/torch/trainer.py``). Each rank's batch holds
its rows of the global batch (``[rank::world]``, read by the sharded loader) or, where Keras hands every rank
the whole batch, all of it. The checked step gathers the rows (one all_gather per input, in the global batch's
order) and, after the distributed step, every rank runs the model class' own ``train_step`` on the whole global
batch with every distkeras hook off: no collective, one device's arithmetic. Every rank compares the same
values, so every rank comes to the same verdict (and raises together: no rank is left waiting in a collective).

With ``shard=`` (the training state split over the ranks, :mod:`.shard`), and with ``strategy="model"``
(variables split over the model shards, :mod:`.tensor`), the checked step reads the state whole: every weight and optimizer slot gathered on every rank
(collective, as a save gathers them) for the snapshot, split again for the distributed step (which runs exactly as
unchecked), gathered again for its result and the replay, and split again after, each rank keeping its part of the
distributed result.
"""

import contextlib

from .. import verifying
from . import collectives


def global_batch(replica, local):
    """The global batch of which ``local`` (what Keras handed this rank's step) is this rank's part."""
    import keras
    import torch

    entry = next((e for e in replica.read if e[0] is local), None)
    if entry is None:
        return local  # every rank was handed the whole batch
    rows, count, total = entry

    def whole(value):
        shape = getattr(value, "shape", None)
        if shape is None or not len(shape):
            return value
        tensor = torch.as_tensor(value)
        device = collectives._device()
        gathered = collectives.gather_rows(tensor.to(device), count, replica.rank, replica.world, total)
        return gathered.to(tensor.device)

    return keras.tree.map_structure(whole, rows)


def _rng():
    import torch

    def get():
        return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)

    def set_(state):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state_all(state[1])

    return get, set_


def summed_metrics(entries):
    """The metric states over the job: each rank keeps its own rows' (Keras' metric variables aggregate by sum);
    one all_reduce of them all, in the order every rank lists them."""
    import numpy as np
    import torch
    import torch.distributed as dist

    where = [i for i, (_, kind, _) in enumerate(entries) if kind == "metric"]
    if not where:
        return entries
    flat = torch.cat([torch.as_tensor(np.asarray(entries[i][2], dtype="float64")).reshape(-1) for i in where])
    flat = flat.to(collectives._device())
    dist.all_reduce(flat, group=collectives.data_group())
    flat = flat.cpu().numpy()
    entries, offset = list(entries), 0
    for i in where:
        name, kind, value = entries[i]
        value = np.asarray(value)
        entries[i] = (name, kind, flat[offset:offset + value.size].reshape(value.shape).astype(value.dtype))
        offset += value.size
    return entries


def wrap(model, check, replica, gathered=None, reduce=summed_metrics):
    """``wrap(train_function)`` for :func:`verifying.install`. ``gathered()``: a context manager under which
    the model's state is whole on every rank (collective), split as training holds it outside; by default the
    ``shard=`` state's (``replica.shard.gathered``), nothing without ``shard=``. ``reduce``: the distributed
    state over the job from this rank's (:func:`summed_metrics` over the data-parallel group; None where every
    rank ran the whole batch, as the model shards of one replica do)."""
    if gathered is None and replica is not None and replica.shard is not None:
        gathered = replica.shard.gathered

    def wrapping(function):
        def train_function(data):
            if not check.due:
                return function(data)
            # replica None: every rank runs the whole batch (the model shards of one replica).
            batch = global_batch(replica, data[0]) if replica is not None else data[0]
            handed = []
            whole = _Whole(gathered)

            def distributed():
                # The step's logs for Keras as without the check (the rank's own where nothing reads them); the
                # global ones the step read for the check (trainer._train_step) are what is compared.
                if replica is not None:
                    replica.checked_logs = None
                with whole.split():
                    handed.append(function(data))
                if replica is None:
                    return handed[0]
                logs, replica.checked_logs = replica.checked_logs, None
                return handed[0] if logs is None else logs

            with whole:
                verifying.checked_in_place(
                    model, check, verifying.numpy, distributed, lambda: type(model).train_step(model, batch),
                    random_state=_rng(), reduce=reduce, rows=verifying.rows_of(batch))
            return handed[0]

        return train_function

    return wrapping


class _Whole(object):
    """The training state whole on every rank inside ``with`` (``gathered()``, collective), and split as training
    holds it inside :meth:`split`; nothing where ``gathered`` is None (the state is whole already)."""

    def __init__(self, gathered):
        self.gathered = gathered
        self.held = None

    def __enter__(self):
        if self.gathered is not None:
            self.held = contextlib.ExitStack()
            self.held.enter_context(self.gathered())  # every rank gathers together
        return self

    def __exit__(self, *exc):
        if self.held is not None:
            held, self.held = self.held, None
            held.close()  # each rank keeps its part of what the whole holds now

    @contextlib.contextmanager
    def split(self):
        self.__exit__(None, None, None)
        try:
            yield
        finally:
            self.__enter__()


def wrap_pipeline(model, check, plan, replica=None):
    """``wrap(train_function)`` for a model cut into pipeline stages (:mod:`.pipeline`), one per process: the
    checked step gathers every stage's variables and optimizer slots on every process of the replica (collective,
    as a save does), runs the pipelined step, gathers again (every stage's new values), replays the class' own
    ``train_step`` on the replica's whole batch (``replica``: the data-parallel replicas of the pipeline, whose
    rows are gathered as in :func:`wrap`) and compares; the other stages' storage is freed again after."""
    from . import pipeline as torch_pipeline

    def wrapping(function):
        def train_function(data):
            if not check.due:
                return function(data)
            if replica is not None and replica.shard is not None:
                check.skip("a sharded model (shard=...) is whole on no one device")
                return function(data)
            batch = global_batch(replica, data[0]) if replica is not None else data[0]
            handed = []

            def distributed():
                if replica is not None:  # as in wrap(): the global logs the step read for the check
                    replica.checked_logs = None
                handed.append(function(data))
                torch_pipeline.gather(plan)  # each stage's result, on every process
                logs = replica.checked_logs if replica is not None else None
                if replica is not None:
                    replica.checked_logs = None
                return handed[0] if logs is None else logs

            torch_pipeline.gather(plan)
            try:
                verifying.checked_in_place(
                    model, check, verifying.numpy, distributed, lambda: type(model).train_step(model, batch),
                    random_state=_rng(), reduce=summed_metrics if replica is not None else None,
                    rows=verifying.rows_of(batch))
            finally:
                torch_pipeline.release(plan)
            return handed[0]

        return train_function

    return wrapping
