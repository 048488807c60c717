"""Sharded training on PyTorch: who owns what (ZeRO's ownership layout), which optimizers may split a variable, and
where an optimizer keeps its slots.

Pure functions over sizes and ranks (the same on every rank); :class:`~distkeras.backends.torch.shard.Sharding` uses them.
The module docstring of :mod:`~distkeras.backends.torch.shard` has the rules.
"""

import math


def owners(sizes, world, loads=None):
    """The owner rank of each of ``sizes`` (bytes): greedy, largest first, to the least-loaded rank.

    Args:
        sizes: bytes per variable, in the variables' order (the same on every rank).
        world: the number of ranks.
        loads: bytes already owned per rank (default none).

    Returns:
        A list of ranks, one per size.
    """
    loads = list(loads or [0] * world)
    result = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        result[index] = rank
        loads[rank] += sizes[index]
    return result



#: :meth:`Sharding.owner_map`'s value for a variable split into one flat part per rank (:func:`layout`).
SPLIT = -1



#: A split variable's parts are at least this many elements per rank (smaller ones stay whole).
MIN_PART = 8



#: How far above an even share (1/N of the bytes) :func:`layout` lets the most-loaded rank be.
BALANCE = 1.05



def part_range(size, world, rank):
    """The flat element range ``(start, stop)`` of rank ``rank``'s part of a variable of ``size`` elements
    split into ``world`` parts: contiguous, ``ceil(size / world)`` each, the last one shorter."""
    chunk = -(-size // world)
    start = min(rank * chunk, size)
    return start, min(start + chunk, size)



def layout(sizes, elements, splittable, world, loads=None):
    """Who owns each variable: a rank, or :data:`SPLIT` (one flat part per rank, :func:`part_range`).

    Whole variables first, greedily (:func:`owners`); while the most-loaded rank holds more than
    :data:`BALANCE` times an even share, the largest whole variable that may be split (``splittable``, and
    at least :data:`MIN_PART` elements per part) is split and the rest placed again. A model whose
    variables balance keeps them whole (each optimizer update stays one variable's); one variable that
    is most of the model (a large embedding or kernel) is split, and every rank then holds 1/N of it.

    Args:
        sizes: bytes per variable, in the variables' order (the same on every rank).
        elements: elements per variable.
        splittable: per variable, whether it may be split (the optimizer updates each element from that
            element's own gradient and state only, and the variable has no constraint).
        world: the number of ranks.
        loads: bytes already owned per rank (default none).

    Returns:
        A list with a rank or :data:`SPLIT` per variable.
    """
    base = list(loads or [0] * world)
    split = set()
    while True:
        loads = list(base)
        for index in split:
            for rank in range(world):
                start, stop = part_range(elements[index], world, rank)
                loads[rank] += sizes[index] * (stop - start) // max(elements[index], 1)
        whole = [i for i in range(len(sizes)) if i not in split]
        placed = owners([sizes[i] for i in whole], world, loads)
        for index, rank in zip(whole, placed):
            loads[rank] += sizes[index]
        even = (sum(sizes) + sum(base)) / world
        candidates = [i for i in whole if splittable[i] and elements[i] >= MIN_PART * world]
        if world < 2 or max(loads) <= BALANCE * even or not candidates:
            result = [SPLIT] * len(sizes)
            for index, rank in zip(whole, placed):
                result[index] = rank
            return result
        split.add(min(candidates, key=lambda i: (-sizes[i], i)))



def elementwise(optimizer):
    """Whether ``optimizer`` (the updating one: a LossScaleOptimizer's inner optimizer) updates every element
    of a variable from that element's gradient and state only (and scalars): then a variable may be split
    across ranks in flat parts (:func:`layout`). Keras' own SGD, Adam, AdamW, Adamax, Adagrad, Adadelta,
    RMSprop, Nadam, Lion and Ftrl, as exact classes (Keras' torch subclasses of them included: its
    ``TorchOptimizer.__new__`` makes those); not Lamb, Adafactor, Muon (norms and factors per variable, or
    per matrix), nor a user's subclass (its ``update_step`` may read the whole variable). ``clipnorm``, a
    norm per variable, is summed over the parts (:meth:`Sharding.apply`)."""
    from keras import optimizers

    known = (optimizers.SGD, optimizers.Adam, optimizers.AdamW, optimizers.Adamax, optimizers.Adagrad,
             optimizers.Adadelta, optimizers.RMSprop, optimizers.Nadam, optimizers.Lion, optimizers.Ftrl)
    cls = type(optimizer)
    if cls in known:
        return True
    # Keras' torch optimizers (keras/src/backend/torch/optimizers/torch_*.py, privates): the same update,
    # written with torch._foreach_* over the variables' values.
    return cls.__module__.startswith("keras.src.backend.torch.optimizers.torch_") and any(
        base in known for base in cls.__bases__)



def nbytes(variable):
    """The bytes of ``variable``'s values (its shape and dtype, whether or not its storage is released)."""
    value = variable._value  # Keras' torch Variable keeps its Parameter here (a private; see the module docstring)
    return int(math.prod(variable.shape)) * value.element_size()



def slot_lists(optimizer):
    """The optimizer's per-variable slot lists: its attributes that are lists with one entry per trainable
    variable it was built with, each a Keras variable or None (Keras' optimizers keep ``_momentums``,
    ``_velocities``, ``_accumulated_gradients``, ``_model_variables_moving_average``... this way)."""
    import keras

    trainable = optimizer.__dict__.get("_trainable_variables") or []
    found = []
    for name, value in sorted(vars(optimizer).items()):
        if name == "_trainable_variables" or not isinstance(value, list) or len(value) != len(trainable):
            continue
        if value and all(v is None or isinstance(v, keras.Variable) for v in value) and any(v is not None for v in value):
            if not any(v is t for v, t in zip(value, trainable)):
                found.append(value)
    return found
