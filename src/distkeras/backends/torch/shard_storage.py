"""Sharded training on PyTorch: the release and gather of a variable's storage.

A released variable keeps its torch Parameter with its storage resized to 0 (FSDP's trick) and its class swapped for
one whose ``value`` raises :class:`~distkeras.errors.ShardError`; a split variable keeps its own flat piece. The
owners broadcast what they own. Used by :class:`~distkeras.backends.torch.shard.Sharding` and its tiler.
"""

import contextlib

import torch

from ...errors import ShardError
from . import messages


_RELEASED_CLASSES = {}



#: Depth of calls that take released weights' Parameters as objects, without reading them (_bare_parameters).
_BARE = [0]



def _released_class(base):
    """A subclass of the variable class ``base`` whose ``value`` raises: a released slot's reads."""
    if base not in _RELEASED_CLASSES:

        def value(self):
            raise ShardError(
                "The optimizer variable {!r} is held by another replica: distribute(..., shard=...) keeps each "
                "variable's optimizer state on one replica only. Read optimizer state through model.save() or "
                "model.save_weights() (which gather it), or distribute without shard.".format(self.path)
            )

        _RELEASED_CLASSES[base] = type(base.__name__, (base,), {"value": property(value), "_distkeras_base": base})
    return _RELEASED_CLASSES[base]



def _guarded_class(base):
    """A subclass of the variable class ``base`` for a weight of shard="all", on every rank (its owner's too,
    so that a read outside its layer's call fails on every rank alike, and none waits for the others): its
    ``value`` is the weight while its layer holds it (:class:`_Layer`), else a :class:`_ReleasedView`."""
    key = ("guarded", base)
    if key not in _RELEASED_CLASSES:

        def value(self):
            state = self.__dict__["_distkeras_state"]
            if (state.gathered and allocated(self)) or state.sharding.applying:  # (a tiled kernel: never whole)
                return base.value.__get__(self)
            if _BARE[0]:
                return self._value  # the Parameter object itself (Keras' torch layers track it), not read
            if _symbolic():
                # Keras' torch Variable.value gives a shape-only stub on the "meta" device in a symbolic call
                # (compute_output_spec) and never touches the storage: a released weight may take part.
                return base.value.__get__(self)
            return _released_view(self)

        _RELEASED_CLASSES[key] = type(base.__name__, (base,), {"value": property(value), "_distkeras_guarded": base})
    return _RELEASED_CLASSES[key]



@contextlib.contextmanager
def _bare_parameters():
    """Released weights' ``value`` is their Parameter inside the block: Keras' torch layers' private
    ``_track_variables`` (run by every fit()'s ``_post_build``) collects ``variable.value`` of every variable
    into a ParameterDict, as objects; nothing reads their storage there."""
    _BARE[0] += 1
    try:
        yield
    finally:
        _BARE[0] -= 1



def weight_message(variable):
    return (
        "The weight {!r} of layer {!r} is held by another replica: distribute(..., shard='all') keeps each trainable "
        "variable on one replica and gathers it only while its own layer's call() runs (forward and backward). It "
        "was read outside that call (another layer reading it, as tied weights do, a custom train_step or a callback "
        "computing with layer weights, a weight regularizer). Read weights with model.get_weights() (which gathers "
        "them), or distribute with shard='gradients' (weights replicated).".format(
            variable.path, variable.__dict__.get("_distkeras_layer", "?"))
    )



class _ReleasedView(torch.Tensor):
    """What a released weight's ``value`` is outside its layer's call: a shape-only ("meta") tensor whose
    ``grad`` is the Parameter's (Keras' torch train_step, and the guide's, read ``variable.value.grad`` after
    the backward pass), and any computation with it raises :class:`ShardError` naming the weight. (The
    Parameter itself can't be handed out: its storage is freed, and torch would read freed memory.)"""

    @property
    def grad(self):
        return self._distkeras_parameter.grad

    @grad.setter
    def grad(self, value):
        self._distkeras_parameter.grad = value

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in ("__get__", "__repr__", "__format__", "size", "dim", "numel"):
            with torch._C.DisableTorchFunctionSubclass():  # metadata only (shape, dtype, requires_grad...)
                return func(*args, **(kwargs or {}))
        import keras

        for leaf in keras.tree.flatten([list(args), dict(kwargs or {})]):
            if isinstance(leaf, _ReleasedView):
                raise ShardError(leaf._distkeras_message)
        raise ShardError("A weight held by another replica (distribute(..., shard='all')) was computed with.")



def _released_view(variable):
    view = variable.__dict__.get("_distkeras_view")
    if view is None:
        parameter = variable._value
        stub = torch.empty(parameter.shape, dtype=parameter.dtype, device="meta")
        view = torch.Tensor._make_subclass(_ReleasedView, stub, parameter.requires_grad)
        view._distkeras_parameter = parameter
        view._distkeras_message = weight_message(variable)
        variable.__dict__["_distkeras_view"] = view
    return view



def _symbolic():
    """Whether a symbolic call (Keras' torch compute_output_spec, on the "meta" device) is in flight."""
    from keras.src.backend.torch.core import get_device  # Keras' torch device scope (a private)

    return str(get_device()) == "meta"



def free_storage(variable):
    """Free ``variable``'s storage (keeps its shape, dtype and Parameter object); :func:`alloc_storage` undoes."""
    value = variable._value
    if "_distkeras_nbytes" in variable.__dict__:
        return
    variable.__dict__["_distkeras_nbytes"] = value.untyped_storage().nbytes()
    try:
        value.untyped_storage().resize_(0)
    except RuntimeError:
        # A storage NumPy has shared (Keras' saving reads variables with .numpy()) is not resizable: the
        # Parameter gets a storage of its own (empty() touches no page), which is released instead.
        value.data = torch.empty(value.shape, dtype=value.dtype, device=value.device)
        value.untyped_storage().resize_(0)



def alloc_storage(variable):
    """Re-allocate a freed storage, in place (the same Parameter and storage: what autograd saved stays valid)."""
    nbytes = variable.__dict__.pop("_distkeras_nbytes", None)
    if nbytes is not None:
        variable._value.untyped_storage().resize_(nbytes)



def release(variable):
    """Free ``variable``'s storage and mark it released (its ``value`` raises)."""
    if getattr(type(variable), "_distkeras_base", None) is not None:
        return
    free_storage(variable)
    variable.__class__ = _released_class(type(variable))



def restore(variable):
    """Re-allocate a released ``variable``'s storage (its values undefined until assigned)."""
    base = getattr(type(variable), "_distkeras_base", None)
    if base is None:
        return
    variable.__class__ = base
    alloc_storage(variable)



def is_released(variable):
    return getattr(type(variable), "_distkeras_base", None) is not None



def broadcast_owned(groups, rank):
    """``groups``: per rank, the parts it owns, each ``(variable, start, stop)``: a flat element range of the
    variable (same order on every rank). Each owner's values reach every rank: per owner and (dtype, device)
    one flat buffer, which the owner sends to every other rank and they receive, all of them issued at once
    (as :mod:`~distkeras.backends.torch.messages`: in pieces, a few in flight per link) and then waited for. An owner sends its part's own storage where it keeps one
    (:func:`piece`: a split variable's part, a split slot's) and writes it into the variable's storage too
    where that is allocated. Bytes each rank sends: what it owns, to each other rank (a ring all-gather's).
    Why not ``dist.broadcast``, one per owner, async: gloo ran them one after the other (traced across two
    100 Mbit/s hosts: 0.55 s for the two owners' halves each step, the time of the one-way sum); the direct
    messages of both owners share the link's two directions (0.28-0.33 s in most steps, 0.55 s in some)."""
    pending, world, link = [], len(groups), messages.links()
    for owner, items in enumerate(groups):
        by_kind = {}
        for item in items:
            value = item[0]._value
            by_kind.setdefault((value.dtype, value.device), []).append(item)
        for (dtype, device), group in by_kind.items():
            if owner == rank:
                flat = torch.cat([_source(*item) for item in group])
                sent = [link.send(flat, peer) for peer in range(world) if peer != rank]
            else:
                flat = torch.empty(sum(stop - start for _, start, stop in group), dtype=dtype, device=device)
                sent = [link.recv(flat, owner)]
            pending.append((owner, group, flat, sent))
    messages.wait([message for _, _, _, sent in pending for message in sent])
    for owner, group, flat, _ in pending:
        offset = 0
        with torch.no_grad():  # .data: no autograd version bump on the weights
            for variable, start, stop in group:
                if owner != rank or (piece(variable) is not None and allocated(variable)):
                    variable._value.data.view(-1)[start:stop].copy_(flat[offset : offset + stop - start])
                offset += stop - start



def piece(variable):
    """This rank's part of a split variable or slot, kept in its own storage (None: none kept)."""
    return variable.__dict__.get("_distkeras_piece")



def allocated(variable):
    """Whether ``variable``'s storage holds its values (not freed by :func:`free_storage`)."""
    return "_distkeras_nbytes" not in variable.__dict__



def _source(variable, start, stop):
    kept = piece(variable)
    if kept is not None and variable.__dict__.get("_distkeras_part") == (start, stop):
        return kept
    return variable._value.detach().reshape(-1)[start:stop]



def keep_piece(variable, start, stop):
    """Copy this rank's part ``[start, stop)`` of ``variable``'s (allocated) storage into a storage of its own."""
    kept = variable._value.detach().reshape(-1)[start:stop].clone()
    variable.__dict__["_distkeras_piece"], variable.__dict__["_distkeras_part"] = kept, (start, stop)
    return kept



def release_part(variable, start, stop):
    """Keep only this rank's part of a split variable's slot: its values copied into a storage of their own
    (from the whole, when that is allocated: after a gather or a load), the whole freed and marked released."""
    if is_released(variable):
        return
    keep_piece(variable, start, stop)
    release(variable)



def forget_piece(variable):
    for name in ("_distkeras_piece", "_distkeras_part"):
        variable.__dict__.pop(name, None)
