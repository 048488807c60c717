"""Sharded training on PyTorch: the step's communication. Each gradient travels to its owner only
(:func:`reduce_to_owners`, :class:`OwnerReduce`), and the norms and the finite check that span every rank's
variables are all-reduced (:func:`clip_by_part_norms`, :func:`clip_by_global_norm`, :func:`all_finite`).
"""

import functools
import threading

import torch
import torch.distributed as dist

from . import messages
from .shard_layout import SPLIT


#: Pieces one rank may have waiting at an owner for the other ranks' pieces at their offsets (OwnerReduce).
AHEAD = 2



def reduce_to_owners(grads, variables, count, sharding, compression=None, drop=True):
    """ZeRO-1/2 without overlap: each variable's gradient averaged over the ranks (weighted by their ``count`` of
    samples, as :func:`~distkeras.backends.torch.collectives.average_gradients`) on its owner only (a split
    variable's parts each on its own rank, flat); None elsewhere, and for a variable without a gradient on
    any rank.

    One all-reduce of the has-gradient flags and the counts, then per owner and dtype one flat buffer of
    that owner's gradients (and parts), each already scaled by this rank's share (in the 16-bit wire dtype
    with ``compression``), sent to it (:class:`OwnerReduce`), all at once and then waited for (as
    :func:`broadcast_owned`, for the same reason: the owners' reduces use both directions of a link
    together). With ``drop`` (shard="gradients", "all") the gradients this rank doesn't own whole are
    dropped from their parameters once sent; shard="optimizer" keeps them (ZeRO-1 frees nothing early).
    """
    from .. import policies
    from .collectives import WIRE

    rank, world = sharding.rank, sharding.world
    owner = sharding.owner_map(variables)
    device = next((g.device for g in grads if g is not None), variables[0]._value.device)
    meta = torch.tensor([float(g is not None) for g in grads] + [float(count)], dtype=torch.float64, device=device)
    dist.all_reduce(meta)
    meta = meta.tolist()
    weight = policies.batch_share(count, meta[-1])
    averaged = [None] * len(variables)
    groups = {}
    for index, variable in enumerate(variables):
        if meta[index]:
            dtype = torch.float64 if variable._value.dtype == torch.float64 else torch.float32
            for dst, start, stop in sharding.parts(variable, owner):
                groups.setdefault((dst, dtype), []).append((index, start, stop))
    pending = []
    for (dst, dtype), entries in sorted(groups.items(), key=lambda item: (item[0][0], str(item[0][1]))):
        flat = torch.empty(sum(stop - start for _, start, stop in entries), dtype=dtype, device=device)
        offset = 0
        for index, start, stop in entries:
            piece = flat[offset : offset + stop - start]
            if grads[index] is None or not weight:
                piece.zero_()
            else:
                torch.mul(grads[index].detach().reshape(-1)[start:stop], weight, out=piece)
            offset += stop - start
        wire = flat if compression is None else flat.to(WIRE[compression])
        work = OwnerReduce(wire, dst, rank, world)
        pending.append((dst, entries, flat, wire, work) if dst == rank else (dst, None, None, None, work))
        del flat, wire  # another owner's: the message holds it until it is sent
    for dst, entries, flat, wire, work in pending:
        work.wait()
        if dst != rank:
            continue
        if wire is not flat:
            flat.copy_(wire)
        offset = 0
        for index, start, stop in entries:
            variable = variables[index]
            part = flat[offset : offset + stop - start]
            if owner[id(variable)] != SPLIT:
                part = part.view(variable.shape)
            averaged[index] = part.to(variable._value.dtype)
            offset += stop - start
    if drop:
        for variable in variables:
            if owner[id(variable)] != rank:
                variable._value.grad = None  # sent: not kept here
    return averaged



class OwnerReduce(object):
    """A sum of ``flat`` over the ranks onto ``dst`` only, as point-to-point messages: every other rank sends
    its buffer to the owner, which sums them piece by piece as they arrive (``wait()`` waits for all of it).

    Why not ``dist.reduce``: gloo's reduce is a ring reduce-scatter followed by a gather to the root, so with
    every owner reducing at once each rank sends 1.5x its share of the gradients at N=2 (and more than
    (N-1)/N of them at any N). Sent directly, each rank sends exactly the gradients it doesn't own and
    receives (N-1) copies of the ones it owns: the bytes of a ring reduce-scatter, both ways at once.

    The owner never holds those copies whole: each arrives in pieces (:meth:`messages.Links.recv`'s
    ``on_piece``), and once every rank's piece at an offset is in, they are summed in rank order into ``flat``
    (the same sum however they arrived) and dropped: (N-1) copies of a few pieces, not of the buffer. A
    rank ahead of the others waits once :data:`AHEAD` of its pieces wait for theirs (its stream posts no
    more receives meanwhile): the held pieces stay bounded, however unequal the ranks' pace.
    """

    def __init__(self, flat, dst, rank, world, group=None):
        self.flat, self.rank, self.world, self.sending = flat, rank, world, None
        self.arrived = {}  # piece offset -> {src: buffer}, until all are in
        self.lock = threading.Condition()
        link = messages.links(group)
        if dst != rank:
            self.sent = [link.send(flat, dst)]
            self.flat = None  # the message holds it until it is sent
            storage = flat.untyped_storage()
            self.sending = (storage.data_ptr(), storage.nbytes())  # (for Buckets.held_storages; no reference kept)
        else:
            self.sent = [link.recv(flat, src, on_piece=functools.partial(self._arrived, src))
                         for src in range(world) if src != rank]

    def _arrived(self, src, start, buffer):
        with self.lock:
            pieces = self.arrived.setdefault(start, {})
            pieces[src] = buffer
            if len(pieces) < self.world - 1:
                # On src's stream thread: it waits while src is AHEAD pieces ahead (a failed message, a peer gone,
                # ends the wait: its error is raised by wait()).
                while (sum(src in waiting for waiting in self.arrived.values()) > AHEAD
                       and not any(message.error for message in getattr(self, "sent", ()))):
                    self.lock.wait(1.0)
                return
            del self.arrived[start]
            self.lock.notify_all()
        mine = self.flat[start : start + buffer.numel()]
        pieces[self.rank] = mine
        order = sorted(pieces)  # rank order, as one all-reduce of the whole buffers would add them
        total = pieces[order[0]]  # summed in place (a received piece, or this rank's own slice)
        for other in order[1:]:
            total.add_(pieces[other])
        if total is not mine:
            mine.copy_(total)

    def held_storages(self):
        """Received pieces, waiting for the other ranks' pieces at their offset or still arriving, ``{data_ptr:
        bytes}``."""
        with self.lock:
            buffers = [b.untyped_storage() for pieces in self.arrived.values() for b in pieces.values()]
        held = {storage.data_ptr(): storage.nbytes() for storage in buffers}
        if self.flat is not None:  # the owner: also the pieces posted and not arrived yet
            held.update(messages.Links.posted(self.sent))
        return held

    def wait(self):
        messages.wait(self.sent)



def clip_by_part_norms(grads, variables, optimizer, split, device):
    """Keras' ``clipnorm`` (each gradient scaled to a norm of at most ``clipnorm``) where some of ``grads``
    are this rank's parts of split variables (``split``: id -> position among the model's split variables):
    their squares summed over the ranks (one all-reduce, every rank, also one with no gradient), then Keras'
    formula (``BaseOptimizer._clip_by_norm``) with the whole variable's norm; the others are Keras' own."""
    squares = torch.zeros(len(split), dtype=torch.float64, device=device)
    for grad, variable in zip(grads, variables):
        if grad is not None and id(variable) in split:
            squares[split[id(variable)]] += torch.sum(torch.square(grad.detach().to(torch.float64)))
    dist.all_reduce(squares)
    clip_norm = optimizer.clipnorm
    clipped = []
    for grad, variable in zip(grads, variables):
        if grad is None or id(variable) not in split:
            clipped.append(grad if grad is None else optimizer._clip_by_norm(grad))
            continue
        l2sum = squares[split[id(variable)]].to(torch.float32)
        l2norm = torch.sqrt(l2sum) if float(l2sum) > 0 else l2sum
        clipped.append(grad * clip_norm / torch.maximum(l2norm, torch.tensor(clip_norm, dtype=torch.float32)).to(grad.dtype))
    return clipped



def clip_by_global_norm(grads, clip_norm, device):
    """Keras' ``clip_by_global_norm`` over every rank's part of the gradients: the squares summed over the
    ranks (one all-reduce), then Keras' own formula (a non-finite norm makes every gradient NaN)."""
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        if grad is not None:
            squares += torch.sum(torch.square(grad.detach().to(torch.float64)))
    dist.all_reduce(squares)
    norm = torch.sqrt(squares).to(torch.float32)
    scale = clip_norm * torch.minimum(1.0 / norm, torch.tensor(1.0 / clip_norm)) + (norm - norm)
    return [g * scale.to(g.dtype) if g is not None else g for g in grads]



def all_finite(local, device):
    """A LossScaleOptimizer's finite check, agreed by every rank: finite only where every part is."""
    flag = torch.tensor([0.0 if bool(local) else 1.0], dtype=torch.float32, device=device)
    dist.all_reduce(flag)
    return torch.tensor(not flag.item())
