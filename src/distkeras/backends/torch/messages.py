"""Point-to-point messages between ranks in pieces, a few in flight per link: the sharded state's traffic on gloo.

Sharded training (:mod:`~distkeras.backends.torch.shard`) moves its bytes as direct messages: each rank sends
the owner its share of the owner's gradients, and each owner sends its updated weights to every rank. On a
link both directions carry a large message at once. Over gloo's TCP pairs that ran at about half the link's
rate: across two namespace hosts at 100 Mbit/s (``tc tbf``), 8 MiB each way sent whole took 0.69 s in most
rounds, one way alone 0.35 s, and gloo's ring all-reduce (its own chunks) 0.71 s for the same bytes. In pieces
with a few in flight per direction the two ways together took 0.36-0.40 s. In the sharded step (``python -m
benchmarks shard-cost``, the 1.6 M-parameter MLP, same hosts) ``shard="gradients"`` cost 1.39-1.51x unsharded
with whole messages, 1.15-1.17x with 8 pieces of 256 KiB in flight, and 0.97-1.06x with 4 of 128 KiB
(:data:`PIECE_BYTES`, :data:`WINDOW`): the bytes in flight per direction must stay small against the link's
queue.

- :class:`Links` (one per process group, :func:`links`): per peer and direction a *stream*, a queue of pieces
  in the order the messages were made. Every rank makes its messages in the same order (the buckets, the
  owners' broadcasts), so the k-th piece sent from rank a to rank b pairs with the k-th piece b receives from
  a: one tag for all of them, gloo matches them in order.
- Each stream has a thread of its own that posts its pieces (``isend``/``irecv``) while fewer than
  :data:`WINDOW` are in flight and waits for the oldest: the pieces move while the backward pass goes on,
  and no stream waits on another. (A gloo send or receive is known done only by waiting for it:
  ``Work.is_completed()`` stays False until ``wait()``. One thread waiting for every stream's oldest piece
  in turn can deadlock with a peer doing the same across two full windows; a thread per stream can't.)
  :meth:`Message.wait` waits for a message; a piece that failed (a peer gone: gloo's timeout) raises there.
- Where every rank is on this host (:func:`configure`) the pieces are larger, :data:`ONE_HOST_PIECE_BYTES`, with
  :data:`ONE_HOST_WINDOW` in flight: no link to share, and a piece costs a thread hand-off (over loopback 128 KiB
  pieces made the sharded MLP's step 1.4-1.5x unsharded's, whole messages 0.8-1.0x), but an owner posts a receive
  buffer per piece in flight from each of the N-1 others (with 4 MiB pieces, 4 in flight, up to 112 MiB at N=8:
  the memory ``shard`` saves). On other process group backends (NCCL) messages go whole, at once.
"""

import collections
import queue as queues
import threading

import torch.distributed as dist

#: Bytes per piece, and pieces in flight per peer and direction (see the module docstring for the measurement).
PIECE_BYTES = 128 << 10
WINDOW = 4
#: Bytes per piece where every rank is on this host: large (a hand-off per piece costs there), but bounded, so that
#: a message received piece by piece (:meth:`Links.recv`'s ``on_piece``) never needs a buffer of its whole size.
ONE_HOST_PIECE_BYTES = 1 << 20
#: Pieces in flight per peer and direction there: an owner posts up to (N-1) x this many receive buffers.
ONE_HOST_WINDOW = 2
#: One tag for every piece (the order pairs them); distinct from the tags of anything else sent on the group.
TAG = 0x6B64

_links = {}
#: Whether every rank of the job runs on this host (set by the adapter: :func:`configure`).
_one_host = [False]


def configure(one_host):
    """Tell the messages whether every rank runs on this host (then their pieces are ONE_HOST_PIECE_BYTES)."""
    _one_host[0] = bool(one_host)


class Message(object):
    """One tensor sent to, or received from, one peer; done when all its pieces are."""

    def __init__(self, pieces):
        self.left = pieces
        self.fresh = []  # a message received piece by piece: its _Fresh pieces (their buffers while posted)
        self.error = None
        self.event = threading.Event()
        if not pieces:
            self.event.set()

    @property
    def done(self):
        return self.event.is_set()

    def _piece_done(self, error=None):
        self.error = self.error or error
        self.left -= 1
        if self.left == 0 or error is not None:
            self.event.set()

    def wait(self):
        self.event.wait()
        if self.error is not None:
            raise self.error


class _Fresh(object):
    """A piece received into a buffer made when it is posted, handed to ``on_piece(start, buffer)`` once here."""

    def __init__(self, like, start, stop, on_piece):
        self.like, self.start, self.stop, self.on_piece, self.buffer = like, start, stop, on_piece, None

    def make(self):
        import torch

        return torch.empty(self.stop - self.start, dtype=self.like.dtype, device=self.like.device)


class _Stream(object):
    """One peer and direction: a queue of pieces and the thread that moves them (see the module docstring)."""

    def __init__(self, post):
        self.post = post  # (tensor) -> work
        self.todo = queues.Queue()
        self.thread = threading.Thread(target=self._run, name="distkeras-messages", daemon=True)
        self.thread.start()

    def _run(self):
        flying = collections.deque()
        while True:
            if not flying or not self.todo.empty():
                try:
                    while len(flying) < (ONE_HOST_WINDOW if _one_host[0] else WINDOW):
                        piece, message = self.todo.get(block=not flying)
                        try:
                            if isinstance(piece, _Fresh):  # received into a buffer of its own, made now
                                piece.buffer = piece.make()
                                flying.append((self.post(piece.buffer), message, piece))
                            else:
                                flying.append((self.post(piece), message, None))
                        except Exception as error:  # noqa: BLE001 (handed to the waiting thread)
                            message._piece_done(error)
                except queues.Empty:
                    pass
            if flying:
                work, message, fresh = flying.popleft()
                try:
                    work.wait()
                    if fresh is not None:
                        buffer, fresh.buffer = fresh.buffer, None  # on_piece holds it from now on, or drops it
                        fresh.on_piece(fresh.start, buffer)
                except Exception as error:  # noqa: BLE001
                    message._piece_done(error)
                else:
                    message._piece_done()
                del work, fresh


class Links(object):
    """The streams of one process group (see the module docstring)."""

    def __init__(self, group=None):
        self.group = group
        self.streams = {}
        self.lock = threading.Lock()
        self.whole = dist.get_backend(group) != "gloo"

    def _stream(self, kind, peer):
        key = (kind, peer)
        with self.lock:
            if key not in self.streams:
                group = self.group
                if kind == "send":
                    self.streams[key] = _Stream(lambda t: dist.isend(t, peer, group=group, tag=TAG))
                else:
                    self.streams[key] = _Stream(lambda t: dist.irecv(t, peer, group=group, tag=TAG))
            return self.streams[key]

    def _message(self, kind, tensor, peer, on_piece=None):
        flat = tensor.view(-1)
        if self.whole:
            size = flat.numel()
        else:
            size = max(1, (ONE_HOST_PIECE_BYTES if _one_host[0] else PIECE_BYTES) // flat.element_size())
        starts = range(0, flat.numel(), size)
        if on_piece is None:
            pieces = [flat[start : start + size] for start in starts]
        else:
            pieces = [_Fresh(flat, start, min(start + size, flat.numel()), on_piece) for start in starts]
        message = Message(len(pieces))
        if on_piece is not None:
            message.fresh = pieces
        if pieces:
            stream = self._stream(kind, peer)
            for piece in pieces:
                stream.todo.put((piece, message))
        return message

    @staticmethod
    def posted(messages_):
        """The storages of the pieces ``messages_`` receive into now (posted, not yet handed on), ``{data_ptr:
        bytes}`` (the memory benchmark counts them)."""
        storages = {}
        for message in messages_:
            for piece in list(message.fresh):
                buffer = piece.buffer
                if buffer is not None:
                    storage = buffer.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        return storages

    def send(self, tensor, peer):
        """Send contiguous ``tensor`` to rank ``peer``; returns its :class:`Message` (``tensor`` must not change until it is done)."""
        return self._message("send", tensor, peer)

    def recv(self, tensor, peer, on_piece=None):
        """Receive into contiguous ``tensor`` from rank ``peer``; returns its :class:`Message`.

        With ``on_piece``, ``tensor`` only gives the size, dtype and device: each piece arrives in a buffer of its
        own, handed to ``on_piece(start, buffer)`` (``start``: its offset in the message) on the stream's thread
        before the message counts it done; the message never needs a buffer of its whole size."""
        return self._message("recv", tensor, peer, on_piece)


def links(group=None):
    """The :class:`Links` of ``group`` (None: the default group), made on first use for this group object."""
    key = group if group is not None else dist.group.WORLD
    found = _links.get(id(key))
    if found is None or found[0] is not key:
        found = _links[id(key)] = (key, Links(group))
    return found[1]


def wait(messages):
    """Until every one of ``messages`` is done (raises the first failure)."""
    for message in messages:
        if message is not None:
            message.wait()
