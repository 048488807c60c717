"""What crosses processes in a PyTorch job: every collective the training hooks use, written once.

Each function is called by every rank, the same number of times and in the same order: the tensors
of a call are flattened into one buffer (one collective per call, not one per variable) in an order
every rank derives alike (the model's variable order; metric names sorted).
"""

import collections
import math
import random

import keras
import numpy as np
import torch
import torch.distributed as dist


def broadcast_from_rank0(model):
    """Give every rank rank 0's weights (all of them) and optimizer state."""
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        variables += list(optimizer.variables)
    groups = collections.OrderedDict()
    for variable in variables:
        groups.setdefault((variable.value.dtype, variable.value.device), []).append(variable)
    for group in groups.values():
        flat = torch.cat([v.value.detach().reshape(-1) for v in group])
        dist.broadcast(flat, src=0)
        _scatter(flat, group)


def _numel(variable):
    return int(math.prod(variable.shape))


def _scatter(flat, variables):
    offset = 0
    for variable in variables:
        size = _numel(variable)
        variable.assign(flat[offset : offset + size].reshape(variable.shape).to(variable.value.dtype))
        offset += size


def average_gradients(grads, variables, count):
    """The gradients averaged over the ranks, each rank weighted by its ``count`` of samples.

    One all-reduce of ``[count * grad for every variable] + [has-gradient flags] + [count]``. A variable
    without a gradient on any rank keeps None (Keras skips it, as on one device).
    """
    dtype = torch.float64 if any(g is not None and g.dtype == torch.float64 for g in grads) else torch.float32
    device = next((g.device for g in grads if g is not None), variables[0].value.device)
    sizes = [_numel(v) for v in variables]
    length = sum(sizes)
    # One buffer; each gradient is written into its slice already weighted (no per-variable temporaries).
    flat = torch.empty(length + len(grads) + 1, dtype=dtype, device=device)
    offset = 0
    for grad, size in zip(grads, sizes):
        piece = flat[offset : offset + size]
        if grad is None:
            piece.zero_()
        else:
            torch.mul(grad.detach().reshape(-1), count, out=piece)
        offset += size
    flat[length:] = torch.tensor([float(g is not None) for g in grads] + [float(count)], dtype=dtype)
    dist.all_reduce(flat)
    flags = flat[length:].tolist()
    flat[:length].div_(flags[-1] or 1.0)
    averaged, offset = [], 0
    for present, variable, size in zip(flags, variables, sizes):
        piece = flat[offset : offset + size]
        averaged.append(piece.view(variable.shape).to(variable.value.dtype) if present else None)
        offset += size
    return averaged


def all_reduce_states(variables, rank, world):
    """Replace each metric variable by its value over the job: summed ("sum", Keras' default for
    metrics), averaged ("mean"), or rank 0's (anything else)."""
    pieces = []
    for variable in variables:
        value = variable.value.detach().reshape(-1).to(torch.float64)
        aggregation = getattr(variable, "aggregation", "sum")
        if aggregation == "mean":
            value = value / world
        elif aggregation != "sum":
            value = value * float(rank == 0)
        pieces.append(value)
    flat = torch.cat(pieces)
    dist.all_reduce(flat)
    _scatter(flat, variables)


def plain(value):
    array = np.array(keras.ops.convert_to_numpy(value))
    return float(array) if array.ndim == 0 and array.dtype.kind in "fiub" else array


def average_logs(logs, world):
    """A custom step's own logs (not the model's metrics): average the scalar ones over the ranks."""
    values = {k: plain(v) for k, v in logs.items()}
    names = sorted(k for k, v in values.items() if isinstance(v, float))
    if names:
        flat = torch.tensor([values[k] for k in names], dtype=torch.float64, device=_device())
        dist.all_reduce(flat)
        values.update(zip(names, (flat / world).tolist()))
    return values


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def sync_random_state():
    """Every rank takes rank 0's state of Python's, NumPy's and torch's global random generators."""
    state = [random.getstate(), np.random.get_state(), torch.get_rng_state()]
    dist.broadcast_object_list(state, src=0)
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])
