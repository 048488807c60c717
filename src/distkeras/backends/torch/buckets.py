"""The gradient all-reduce overlapped with the backward pass, in buckets (PyTorch DDP's Reducer, for a Keras model).

Without overlap a step computes every gradient, then sends them all: compute plus communication. Here
every trainable variable's torch parameter carries a ``register_post_accumulate_grad_hook``: as soon as
the backward pass has written a variable's ``.grad``, the hook copies it, already weighted by this rank's
share of the global batch, into its bucket's buffer, and when a bucket is full its all-reduce starts
(``async_op=True``) while the backward pass goes on with earlier layers. The optimizer's ``apply`` (see
:mod:`~distkeras.backends.torch.trainer`) launches what is left, waits for every bucket and hands the
averages on: a step takes about max(compute, communication) once the model is large enough.

- **Buckets** (:func:`assign`): the variables in reverse order (the order the backward pass produces
  their gradients, roughly), grouped until a bucket holds ``bucket_mb`` MiB as sent (the first one 1 MiB
  at most, so communication starts early), as DDP's ``bucket_cap_mb`` and its 1 MiB first bucket. A
  variable without a gradient in a step (a layer the step doesn't call) holds its bucket, and the ones
  after it, until ``apply``: correct, less overlapped (DDP's ``find_unused_parameters`` would learn it).
  With ``shard`` a bucket holds one owner's gradients, and only one bucket is open at a time (owners alternate
  along the model; a bucket gathering one owner's gradients across the model held the others' full buckets
  back behind it). After a layout's first step the buckets are made again in the order that step's
  gradients came in (rank 0's, on every rank), as DDP rebuilds its buckets after its first iteration.
- **One order on every rank.** Collectives pair up by the order each rank issues them, so bucket k is
  launched only once buckets 0..k-1 are: a full bucket waits for the ones before it, as in DDP's
  Reducer. The buckets travel on a process group of their own (:func:`bucket_group`), so they never pair
  with another collective of the step (BatchNormalization's statistics, which cross ranks inside the
  backward pass) and don't queue in front of them.
- **Exact averages.** Each rank scales its gradients by ``count / total`` (its samples in the step over
  the global batch, which every rank holds, so known without communicating), and the buckets' sum is the
  average, however unequal the shares; a rank with no samples (a stand-in step) sends zeros. The last
  bucket (the model's first variables, whose gradients the backward pass produces last) leaves at
  ``apply`` with a few numbers more: per-variable "has a gradient" flags (a variable without a gradient on
  any rank stays None, as on one device) and the fallback flag below, so a step makes no all-reduce more
  than the buckets (a model within one bucket: one, as without overlap). With ``compression`` the
  buffers are in the 16-bit wire dtype (flags too: a sum of zeros and ones is zero only when all are),
  cast back for the optimizer.
- **Fallback**, decided by all ranks together (its flag travels in the last bucket): when a hook fired
  twice for one variable in a step (``backward()`` called more than once), or ``apply`` received anything
  but the very ``.grad`` tensors the hooks saw, unchanged (a ``train_step`` that transformed them, or
  computed them with ``torch.autograd.grad``, where no hook fires), the buckets are waited for and dropped,
  and the gradients ``apply`` received are averaged as without overlap
  (:func:`~distkeras.backends.torch_collectives.average_gradients`). Overlap is then off for the rest of
  this distribution (the step does the same next time), with a warning on rank 0.

Hooks do nothing outside a train step in flight. :meth:`Buckets.remove` takes them off the parameters.
"""

import datetime
import logging

import torch
import torch.distributed as dist

from ...errors import DistKerasError
from .. import policies
from . import collectives
from .shard_step import OwnerReduce

logger = logging.getLogger("distkeras")

MIB = 1 << 20
#: DDP's default first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``); the adapter's DEFAULT_BUCKET_MB is
#: its ``bucket_cap_mb`` default.
FIRST_BUCKET_BYTES = 1 << 20
#: With shard: at most this many buckets' bytes of gradients on their way to other owners (Buckets._hold_back); with
#: shard="all", whose point is memory, one (the MLP benchmark at N=8: 0.231 of one device's bytes with two, where
#: the in-flight parts of its split kernel were the largest term left).
SENDING_BUCKETS = 2
SENDING_BUCKETS_ALL = 1

#: What ``seen`` holds for a tiled kernel once every part of its gradient came (it never has a whole ``.grad``).
TILED = "tiled"
#: (the default group, the timeout, the buckets' group made for them): once per process, not per distribute().
_group = [None, None, None]


def bucket_group(timeout):
    """A process group of every rank for the buckets only, whose collectives wait ``timeout`` seconds
    (made on first use, and again for another timeout: a collective call, as distribute() is)."""
    world = dist.group.WORLD
    if _group[0] is not world or _group[1] != timeout:
        _group[:] = [world, timeout, dist.new_group(timeout=datetime.timedelta(seconds=timeout))]
    return _group[2]


def assign(sizes, keys, bucket_bytes, first_bytes=FIRST_BUCKET_BYTES, contiguous=False, order=None):
    """Units ``0..n-1`` (``sizes`` in bytes, ``keys`` their buffer dtype, device and owner) in buckets.

    The units are taken in ``order`` (the order their gradients are expected in; None: reverse order, the
    backward pass' order roughly); a bucket of one key closes once it holds ``bucket_bytes`` (the first bucket
    of a key ``min(first_bytes, bucket_bytes)``), as ``torch.distributed._compute_bucket_assignment_by_size``
    does. With ``contiguous`` (sharded: the key holds the owner, and owners alternate along the model) only one
    bucket is open at a time: it also closes where the next unit has another key, and a unit of
    ``bucket_bytes`` or more gets a bucket of its own. A bucket then never gathers one owner's gradients
    across the model while the others' wait behind it in the launch order (every rank held up to N-1
    partly filled buckets), and another owner's large gradient can be sent from its own storage.
    Returns lists of unit indices, ordered by where their first unit comes in ``order``.
    """
    order = list(reversed(range(len(sizes)))) if order is None else list(order)
    position = {unit: place for place, unit in enumerate(order)}
    done, open_buckets = [], {}
    for index in order:
        key = keys[index]
        if contiguous:
            for other in [k for k in open_buckets if k != key]:  # closed first: one open bucket at a time
                done.append((other, open_buckets.pop(other)["indices"]))
            if sizes[index] >= bucket_bytes:
                if key in open_buckets:
                    done.append((key, open_buckets.pop(key)["indices"]))
                done.append((key, [index]))
                continue
        bucket = open_buckets.setdefault(key, {"indices": [], "bytes": 0, "first": not any(key == k for k, _ in done)})
        bucket["indices"].append(index)
        bucket["bytes"] += sizes[index]
        limit = min(first_bytes, bucket_bytes) if bucket["first"] else bucket_bytes
        if bucket["bytes"] >= limit:
            done.append((key, open_buckets.pop(key)["indices"]))
    done.extend((key, bucket["indices"]) for key, bucket in open_buckets.items())
    return sorted((indices for _, indices in done), key=lambda indices: position[indices[0]])


class _Bucket(object):
    def __init__(self, entries, length, dtype, device, owner=None):
        #: (variable index, offset in the buffer, start, stop): the flat elements [start, stop) of that
        #: variable's gradient (all of it, or with shard one owner's part of a split variable).
        self.entries, self.length, self.dtype, self.device = entries, length, dtype, device
        self.owner = owner  # with shard: the rank the bucket is reduced to (None: all-reduced)
        self.buffer = self.work = None
        self.pending = self.flags = 0

    def filled(self):
        """The buffer, made when the step first writes into it (a bucket holds no memory before its first gradient)."""
        if self.buffer is None:
            self.buffer = torch.empty(self.length + self.flags, dtype=self.dtype, device=self.device)
        return self.buffer


def _buffer_dtype(variable, compression):
    if compression is not None:
        return collectives.WIRE[compression]
    return torch.float64 if variable._value.dtype == torch.float64 else torch.float32


class Buckets(object):
    """The hooks and buckets of one distributed model (see the module docstring).

    Args:
        replica: the :class:`~distkeras.backends.torch_trainer.Replica` (rank, world, compression, and the
            sample counts of the step in flight).
        bucket_mb: MiB of gradients (as sent) per bucket.
    """

    def __init__(self, replica, bucket_mb):
        self.replica = replica
        self.bucket_bytes = max(1, int(bucket_mb * MIB))
        self.group = bucket_group(replica.timeout)
        self.enabled = True
        self.collecting = False
        #: With shard: the :class:`~distkeras.backends.torch.shard.Sharding`. Buckets then hold one owner's
        #: variables (and parts of split ones) and are reduced to it (the bytes of half an all-reduce: the owners
        #: broadcast the rest).
        self.sharding = None
        #: With sharding: a rank drops the gradients it doesn't own once sent (shard="gradients", "all"; ZeRO-1
        #: keeps them, so a step whose gradients the buckets can't use may still fall back).
        self.drop = True
        self.freed = False
        self._owned = []
        self._ids, self._slot = None, {}
        #: With shard: the order the gradients came in, in the first step of a layout (then the buckets are
        #: made again in that order, once: ``_rebuilt`` is the layout key that was).
        self._order, self._observed, self._rebuilt = [], None, None
        self._variables, self._where, self._buckets, self._handles = [], [], [], []

    # -- layout

    def _layout(self, variables, order=None):
        """Buckets for ``variables`` (``order``: the variable indices in the order their gradients are expected;
        None: reverse order)."""
        self.remove()
        compression = self.replica.compression
        sharding, rank = self.sharding, self.replica.rank
        self._variables = list(variables)
        self._ids = self._key(variables)
        self._slot = {id(v): i for i, v in enumerate(variables)}
        self._order = list(reversed(range(len(variables)))) if order is None else list(order)
        owner = sharding.owner_map(variables) if sharding is not None else {}
        units, sizes, keys = [], [], []  # per variable in order, its parts: (index, start, stop)
        first_unit = []
        for index, variable in enumerate(variables):
            dtype = _buffer_dtype(variable, compression)
            parts = sharding.parts(variable, owner) if sharding is not None else [(None, 0, variable._value.numel())]
            first_unit.append(len(units))
            for dst, start, stop in parts:
                units.append((index, start, stop))
                sizes.append((stop - start) * dtype.itemsize)
                keys.append((dtype, variable._value.device, dst))
        first_unit.append(len(units))
        unit_order = [unit for index in self._order for unit in reversed(range(first_unit[index], first_unit[index + 1]))]
        # Wholly this rank's (or every rank's, unsharded): its gradient is kept here, and arrives whole.
        self._owned = [owner.get(id(v), rank) == rank for v in variables]
        self._buckets, self._where = [], [[] for _ in variables]
        for unit_indices in assign(sizes, keys, self.bucket_bytes, contiguous=sharding is not None, order=unit_order):
            entries, length = [], 0
            for unit in unit_indices:
                index, start, stop = units[unit]
                entries.append((index, length, start, stop))
                length += stop - start
            bucket = _Bucket(entries, length, *keys[unit_indices[0]])
            for index, offset, start, stop in entries:
                self._where[index].append((bucket, offset, start, stop))
            self._buckets.append(bucket)
        for index, variable in enumerate(variables):
            parameter = variable._value
            if parameter.is_leaf and parameter.requires_grad:
                self._handles.append(parameter.register_post_accumulate_grad_hook(self._hook(index)))

    def _key(self, variables):
        return tuple(id(v) for v in variables), self.sharding.version if self.sharding is not None else None

    def _hook(self, index):
        def on_grad(parameter):
            if self.collecting and self.replica.count is not None:
                self._accumulated(index, parameter.grad)
                if self.drop and self.sharding is not None and self.reason is None:
                    # In its bucket now (on its way to its owner, or this rank's, summed there): not kept twice.
                    parameter.grad = None
                    self.freed = True

        return on_grad

    def remove(self):
        """Take the hooks off the parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._ids = None

    # -- one step

    def begin(self, variables):
        """A train step starts: ``variables`` are the model's trainable ones (the layout follows them)."""
        self.collecting = False
        if self.sharding is not None:
            self.sharding.flush_parts(deliver=False)  # a step that never finished left them: not this step's
        if not self.enabled or not variables:
            return
        if self.sharding is not None:
            self.sharding.owner_map(variables)  # a new layout first (it may gather state: every rank here)
        key = self._key(variables)
        if key != self._ids:
            self._layout(variables)
            self._observed = self._rebuilt = None
        elif self._observed is not None and self._rebuilt != key:
            # DDP's bucket rebuild after its first iteration: the buckets in the order the gradients really came
            # (a functional model's residuals, a layer whose variables were made late), rank 0's order on every
            # rank (collectives pair by order), so a bucket never waits behind one whose gradient comes later.
            order = torch.tensor(self._observed, dtype=torch.int64, device=self._buckets[0].device)
            dist.broadcast(order, src=0, group=self.group)
            order = order.tolist()
            self._rebuilt = key
            if order != self._order:
                self._layout(variables, order)
        replica = self.replica
        self.weight = policies.batch_share(replica.count, replica.total)
        self.seen = [None] * len(self._variables)
        self.versions = [0] * len(self._variables)
        self.reason = None
        self.freed = False
        self.next = 0
        self.arrival = []  # the variables' indices in the order their gradients came in this step
        self.parts_seen = {}  # a tiled kernel's index -> the starts of its parts delivered so far
        self.sending = []  # this step's messages to other owners, oldest first (the limit on bytes in flight)
        # With the flags after its gradients, held back until apply(); reduced buckets carry none (a flag
        # must reach every rank): the flags are all-reduced on their own then.
        last = self._buckets[-1] if self.sharding is None else None
        for bucket in self._buckets:
            bucket.flags = 1 + len(self._variables) if bucket is last else 0
            bucket.buffer = None  # made at its first gradient (Bucket.filled)
            bucket.pending = len(bucket.entries) + bool(bucket.flags)
            bucket.work = None
        self.collecting = True

    def part_accumulated(self, variable, start, stop, grad):
        """A tiled kernel's part ``[start, stop)`` of its gradient (shard="all": ``shard_tiles._Tiler``), into its bucket as
        the hook puts a whole gradient. False (nothing taken) outside a collected step: the caller keeps it."""
        index = self._slot.get(id(variable))
        if not self.collecting or self.replica.count is None or index is None or self.reason is not None:
            return False
        parts = self.parts_seen.setdefault(index, set())
        if start in parts or self.seen[index] is not None:
            self.reason = self.reason or "a gradient was accumulated twice in one step (backward() ran twice)"
            return True
        parts.add(start)
        entries = [entry for entry in self._where[index] if entry[2] == start]
        if len(parts) == len(self._where[index]):
            self.seen[index], self.versions[index] = TILED, 0
            self.arrival.append(index)
            self.freed = True
        if self._fill(index, grad.detach().reshape(-1), entries, base=start):
            self._launch_ready()
        return True

    def _accumulated(self, index, grad):
        if grad is None:
            return
        if self.seen[index] is not None:
            self.reason = self.reason or "a gradient was accumulated twice in one step (backward() ran twice)"
            return
        self.seen[index], self.versions[index] = grad, grad._version
        self.arrival.append(index)
        if self._fill(index, grad.detach().reshape(-1), self._where[index]):
            self._launch_ready()

    def _fill(self, index, flat, entries, base=0):
        """``flat`` (elements ``base``... of variable ``index``'s gradient) into the buckets of ``entries``;
        whether one of them is complete now."""
        ready = False
        for bucket, offset, start, stop in entries:
            start, stop = start - base, stop - base
            if self._in_place(bucket, index, flat):
                # A bucket that is one part of a gradient this rank drops once sent (a split variable's part,
                # or a large variable of another owner): scaled in place and sent from the gradient's own
                # storage, no copy (the step never holds a gradient twice; the message frees it once sent).
                bucket.buffer = flat[start:stop]
                bucket.buffer.mul_(self.weight) if self.weight else bucket.buffer.zero_()
                bucket.pending -= 1
                ready = ready or not bucket.pending
                continue
            piece = bucket.filled()[offset : offset + stop - start]
            if self.weight:
                torch.mul(flat[start:stop], self.weight, out=piece)
            else:  # a stand-in step: zeros (a product could carry its inf or nan to the other ranks)
                piece.zero_()
            bucket.pending -= 1
            ready = ready or not bucket.pending
        return ready

    def _in_place(self, bucket, index, flat):
        return (self.drop and self.reason is None and self.sharding is not None and bucket.owner != self.replica.rank
                and not self._owned[index] and len(bucket.entries) == 1 and not bucket.flags
                and flat.dtype == bucket.dtype and flat.device == bucket.device)

    def _launch_ready(self):
        while self.next < len(self._buckets) and not self._buckets[self.next].pending:
            bucket = self._buckets[self.next]
            if bucket.owner is None:
                bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
            else:
                # Sent to the owner directly (shard_step.OwnerReduce: the bytes of a reduce-scatter, not gloo's reduce).
                bucket.work = OwnerReduce(bucket.buffer, bucket.owner, self.replica.rank, self.replica.world,
                                          group=self.group)
                if bucket.owner != self.replica.rank:
                    bucket.buffer = None  # the message holds it until sent, then it is freed (ZeRO-2's memory)
                    self.sending.append((bucket.work, bucket.length * bucket.dtype.itemsize))
                    self._hold_back()
            self.next += 1

    def _hold_back(self):
        """With shard: while the gradients on their way to other owners exceed :data:`SENDING_BUCKETS` buckets'
        bytes, wait for the oldest (inside the backward pass, which waits with it: DeepSpeed's bound on its
        reduce buckets), so the step never holds more of the others' gradients than that."""
        self.sending = [(work, size) for work, size in self.sending if not all(m.done for m in work.sent)]
        limit = (SENDING_BUCKETS_ALL if self.sharding.mode == "all" else SENDING_BUCKETS) * self.bucket_bytes
        while self.sending and sum(size for _, size in self.sending) > limit:
            work, _ = self.sending.pop(0)
            work.wait()

    def _check(self, grads, variables):
        """Why these are not the gradients the hooks sent (None when they are)."""
        for grad, variable in zip(grads, variables):
            slot = self._slot.get(id(variable))
            # Tensor._version (a torch private, pinned by the tests) counts in-place changes of a tensor.
            other = slot is None or grad is not self.seen[slot]
            if slot is not None and grad is None and self.drop and self.sharding is not None and self.seen[slot] is not None:
                continue  # in its bucket, and dropped by the hook (shard="gradients", "all")
            if other or (grad is not None and grad._version != self.versions[slot]):
                return "optimizer.apply() received other gradients than the .grad tensors of the backward pass"
        return None

    def finish(self, grads, variables, count):
        """In ``optimizer.apply``: the averaged gradients of ``variables``, or None for the fallback.

        Writes the flags into the last bucket, launches the buckets not launched yet (a variable without a
        gradient here counts zero), waits for every bucket.
        """
        if self.sharding is not None:
            self.sharding.flush_parts()  # a tiled layer used more often than its backward ran: its parts held so far
        self.collecting = False
        reason = self.reason or self._check(grads, variables)
        for bucket in self._buckets[self.next :]:
            for index, offset, start, stop in bucket.entries:
                if self.seen[index] is None:
                    bucket.filled()[offset : offset + stop - start].zero_()
            bucket.pending = 0
        flags = [float(reason is not None)] + [float(bool(count) and grad is not None) for grad in self.seen]
        if self.sharding is None:
            last = self._buckets[-1]
            last.filled()[last.length :].copy_(torch.tensor(flags))
            self._launch_ready()
        else:
            self._launch_ready()
            table = torch.tensor(flags + [float(self.freed)], dtype=torch.float32, device=self._buckets[0].device)
            dist.all_reduce(table, group=self.group)
        for bucket in self._buckets:
            bucket.work.wait()
        flags = last.buffer[last.length :].tolist() if self.sharding is None else table.tolist()
        if flags[0] and self.sharding is not None and flags[-1]:
            self.end()
            raise DistKerasError(
                "With shard='gradients' each gradient is sent to the replica that owns it during the backward pass "
                "and dropped by the others, and this step {} (on this or another replica), so the gradients it wants "
                "applied are gone. Pass overlap=False to distribute() to send them after the backward pass "
                "instead.".format(reason or "applied other gradients than the backward pass' own"))
        if flags[0]:
            self.end()
            self.enabled = False
            if self.replica.rank == 0:
                logger.warning(
                    "gradients are all-reduced after the backward pass from now on, not overlapped with it: %s. "
                    "Pass overlap=False to distribute() to skip the attempt.",
                    reason or "on another rank, optimizer.apply() received other gradients than the .grad tensors "
                    "of the backward pass",
                )
            return None
        if self.sharding is not None and self._observed is None and self._rebuilt is None:
            came = set(self.arrival)  # those without a gradient here: where the layout expected them
            self._observed = self.arrival + [index for index in self._order if index not in came]
        averaged = []
        for variable in variables:
            slot = self._slot[id(variable)]
            mine = [(b, o, start, stop) for b, o, start, stop in self._where[slot] if b.owner in (None, self.replica.rank)]
            if not flags[1 + slot] or not mine:
                averaged.append(None)
                continue
            bucket, offset, start, stop = mine[0]
            value = bucket.buffer[offset : offset + stop - start]
            if self._owned[slot]:  # the whole gradient (a split variable's part stays flat)
                value = value.view(variable.shape)
            averaged.append(value.to(variable._value.dtype))
        self.end()
        return averaged

    def held_storages(self):
        """The gradient storages the buckets hold now, ``{data_ptr: bytes}`` (a storage once): their buffers, those
        still being sent, and an owner's received pieces waiting for the others' (for the memory benchmark:
        distkeras' own gradient memory, besides ``.grad``)."""
        storages = {}
        for bucket in self._buckets:
            if bucket.buffer is not None:
                storage = bucket.buffer.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            if isinstance(bucket.work, OwnerReduce):
                if bucket.work.sending and not all(message.done for message in bucket.work.sent):
                    storages.setdefault(*bucket.work.sending)  # sent from a storage the message still holds
                storages.update(bucket.work.held_storages())
        return storages

    def end(self):
        """The train step is over (also when it failed): nothing is collected until the next one."""
        self.collecting = False
        self.seen = []
        for bucket in self._buckets:
            bucket.buffer = bucket.work = None
