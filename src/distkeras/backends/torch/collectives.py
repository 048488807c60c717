"""What crosses processes in a PyTorch job: every collective the training hooks use, written once.

Each function is called by every rank, the same number of times and in the same order: the tensors
of a call are flattened into one buffer (one collective per call, not one per variable) in an order
every rank derives alike (the model's variable order; metric names sorted).
"""

import collections
import math

import keras
import numpy as np
import torch
import torch.distributed as dist

from .. import keras_model, policies


#: Where data parallelism's collectives run: ``group`` (None: every process) and ``src``, the global rank of its
#: first member. Tensor parallelism with several replicas makes one such group per model shard
#: (:func:`use_data_group`); the random state is still every process' (:func:`sync_random_state`).
_DATA = {"group": None, "src": 0}


def use_data_group(group=None, src=0):
    """Run the data-parallel collectives on ``group`` (None: every process), broadcasting from global rank ``src``."""
    _DATA.update(group=group, src=src)


def data_group():
    return _DATA["group"]


def broadcast_from_rank0(model):
    """Give every rank rank 0's weights (all of them), metric state and every optimizer's state."""
    broadcast_variables(keras_model.state_variables(model))


def broadcast_variables(variables):
    """Give every rank rank 0's values of ``variables`` (in the same order on every rank)."""
    groups = collections.OrderedDict()
    for variable in variables:
        groups.setdefault((variable._value.dtype, variable._value.device), []).append(variable)
    for group in groups.values():
        flat = torch.cat([v.value.detach().reshape(-1) for v in group])
        dist.broadcast(flat, src=_DATA["src"], group=_DATA["group"])
        _scatter(flat, group)


def check_same_variables(variables, what="variables"):
    """Raise the same :class:`~distkeras.errors.CollectiveError` on every rank of the data group where the ranks'
    ``variables`` (about to be broadcast from rank 0) differ in number, shape or dtype, naming what each rank has
    that another lacks (:func:`~distkeras.backends.policies.variables_differ`); return quietly where they agree.
    One all-gather of two integers where they agree (a broadcast of buffers of other sizes would wait forever);
    the names cross only when they don't."""
    if not dist.is_initialized():
        return
    group = _DATA["group"]
    world = dist.get_world_size(group)
    if world < 2:
        return
    lines, fingerprint = policies.variable_lines(variables)
    mine = torch.tensor(list(fingerprint), dtype=torch.int64, device=_device())
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    if all(torch.equal(theirs, every[0]) for theirs in every):
        return
    names = gather_bytes("\n".join(lines).encode(), group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    raise policies.variables_differ([[line for line in text.decode().split("\n") if line] for text in names], ranks,
                                    what)


def gather_bytes(data, group=None):
    """Every rank's ``data`` (bytes), in rank order within ``group`` (collective: two all-gathers)."""
    world = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=_device())
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(max(1, longest), dtype=torch.uint8, device=_device())
    if data:
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(every, padded, group=group)
    return [bytes(t[:int(n.item())].cpu().numpy().tobytes()) for t, n in zip(every, lengths)]


def _numel(variable):
    return int(math.prod(variable.shape))


def _scatter(flat, variables):
    offset = 0
    for variable in variables:
        size = _numel(variable)
        variable.assign(flat[offset : offset + size].reshape(variable.shape).to(variable._value.dtype))
        offset += size


#: The dtype gradients travel in, per ``compression`` value.
WIRE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def average_gradients(grads, variables, count, compression=None):
    """The gradients averaged over the ranks, each rank weighted by its ``count`` of samples.

    Uncompressed: one all-reduce of ``[count * grad for every variable] + [has-gradient flags] + [count]``.
    With ``compression`` (``"bf16"``/``"fp16"``) the flags and counts go first (a few floats, full
    precision), each rank scales its gradients by its share ``count / total`` so the sum is already the
    average (no overflow in fp16 from large counts), and the gradients travel in the compressed dtype, half
    the bytes; they are cast back before the optimizer (``bf16_compress_hook`` of PyTorch DDP, with the
    weighting kept). The weight is :func:`~distkeras.backends.policies.batch_share`; uncompressed, the division by
    the total comes after the sum, since the total travels in the same all-reduce. A variable without a gradient on any rank keeps None (Keras skips it, as on one device).
    """
    dtype = torch.float64 if any(g is not None and g.dtype == torch.float64 for g in grads) else torch.float32
    device = next((g.device for g in grads if g is not None), variables[0]._value.device)
    sizes = [_numel(v) for v in variables]
    length = sum(sizes)
    meta = [float(g is not None) for g in grads] + [float(count)]
    weight = count
    if compression is not None:
        counts = torch.tensor(meta, dtype=torch.float64, device=device)
        dist.all_reduce(counts, group=_DATA["group"])
        meta = counts.tolist()
        weight = policies.batch_share(count, meta[-1])
    # One buffer; each gradient is written into its slice already weighted (no per-variable temporaries).
    flat = torch.empty(length + (len(grads) + 1 if compression is None else 0), dtype=dtype, device=device)
    offset = 0
    for grad, size in zip(grads, sizes):
        piece = flat[offset : offset + size]
        if grad is None:
            piece.zero_()
        else:
            torch.mul(grad.detach().reshape(-1), weight, out=piece)
        offset += size
    if compression is None:
        flat[length:] = torch.tensor(meta, dtype=dtype)
        dist.all_reduce(flat, group=_DATA["group"])
        meta = flat[length:].tolist()
        flat[:length].div_(meta[-1] or 1.0)
    else:
        wire = flat.to(WIRE[compression])
        dist.all_reduce(wire, group=_DATA["group"])
        flat.copy_(wire)
    averaged, offset = [], 0
    for present, variable, size in zip(meta, variables, sizes):
        piece = flat[offset : offset + size]
        averaged.append(piece.view(variable.shape).to(variable._value.dtype) if present else None)
        offset += size
    return averaged


def all_reduce_states(variables, rank, world, extra=()):
    """Replace each metric variable by its value over the job: summed ("sum", Keras' default for
    metrics), averaged ("mean"), or rank 0's (anything else). The floats ``extra`` are summed over the
    ranks in the same all-reduce, and returned (a list)."""
    pieces = []
    for variable in variables:
        value = variable.value.detach().reshape(-1).to(torch.float64)
        aggregation = getattr(variable, "aggregation", "sum")
        if aggregation == "mean":
            value = value / world
        elif aggregation != "sum":
            value = value * float(rank == 0)
        pieces.append(value)
    if extra:
        pieces.append(torch.tensor([float(v) for v in extra], dtype=torch.float64, device=pieces[0].device))
    flat = torch.cat(pieces)
    dist.all_reduce(flat, group=_DATA["group"])
    _scatter(flat, variables)
    return flat[len(flat) - len(extra):].tolist() if extra else []


def any_rank(flag):
    """True on every rank when ``flag`` is true on any (one all-reduce of one integer)."""
    value = torch.tensor([int(bool(flag))], dtype=torch.int32, device=_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=_DATA["group"])
    return bool(value.item())


def sum_over_processes(vector):
    """The sum over every process of the job of a vector of floats (one all-reduce, float64)."""
    value = torch.tensor(list(vector), dtype=torch.float64, device=_device())
    dist.all_reduce(value)
    return value.cpu().numpy()


def plain(value):
    """A log value as Python/NumPy data: a float for a scalar; a dict (a CompileMetrics result) item by item."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    array = np.array(keras.ops.convert_to_numpy(value))
    return float(array) if array.ndim == 0 and array.dtype.kind in "fiub" else array


def average_logs(logs, weight=1.0):
    """A custom step's own logs (not the model's metrics): the scalar ones averaged over the ranks, each
    rank counted with ``weight`` (0 for a rank whose last step had no samples of its own)."""
    values = {k: plain(v) for k, v in logs.items()}
    names = sorted(k for k, v in values.items() if isinstance(v, float))
    if names:
        flat = torch.tensor([values[k] * weight for k in names] + [weight], dtype=torch.float64, device=_device())
        dist.all_reduce(flat, group=_DATA["group"])
        total = flat.tolist()
        values.update(zip(names, (value / (total[-1] or 1.0) for value in total[:-1])))
    return values


class _Gathered(torch.autograd.Function):
    """Every rank's ``row`` stacked, by rank, with the gradient weighting of :func:`average_gradients`.

    Forward: one all-reduce of a ``(world, *row.shape)`` table holding this rank's row at ``rank``.
    Backward: rank q's loss is the mean over its ``w_q`` samples, and the optimizer receives
    ``sum_q w_q grad_q / sum_q w_q``; for a gradient that crosses ranks through the table to end up with
    that weighting, rank r's row receives ``sum_q w_q dL_q/dtable[r] / w_r`` (one all-reduce; zero for a
    rank with no samples, whose gradients carry no weight).
    """

    @staticmethod
    def forward(ctx, row, rank, world, weight):
        table = row.new_zeros((world,) + tuple(row.shape))
        table[rank] = row
        dist.all_reduce(table, group=_DATA["group"])
        ctx.rank, ctx.weight = rank, weight
        return table

    @staticmethod
    def backward(ctx, grad):
        weighted = grad * ctx.weight if ctx.weight else torch.zeros_like(grad)
        dist.all_reduce(weighted, group=_DATA["group"])
        own = weighted[ctx.rank] / ctx.weight if ctx.weight else torch.zeros_like(grad[ctx.rank])
        return own, None, None, None


def gather_statistics(row, rank, world, weight):
    """Every rank's ``row`` of BatchNormalization statistics (counts, means, squared deviations per channel),
    stacked by rank: the collective of :func:`distkeras.backends.batchnorm.global_moments`.

    Differentiable: gradients reach every rank's inputs through the statistics as on one device (see
    :class:`_Gathered`). A rank of ``weight`` 0 has no samples in this step: it runs the layer on a stand-in
    sample to join the collectives, and contributes nothing.
    """
    if not weight:  # where(), not a product: a stand-in sample's inf or nan must not reach the others
        row = torch.where(torch.zeros_like(row, dtype=torch.bool), row, torch.zeros_like(row))
    return _Gathered.apply(row, rank, world, float(weight))


def gather_rows(value, count, rank, world, total):
    """Every rank's rows of a global batch of ``total``, back in the global batch's order, on every rank.

    Rank r holds rows ``[r::world]`` (``count`` of them; a rank with none holds a stand-in row, ignored).
    One all_gather of every rank's rows, padded to the largest share.
    """
    shares = [len(range(total)[r::world]) for r in range(world)]
    padded = value.new_zeros((max(shares),) + tuple(value.shape[1:]))
    padded[:count] = value[:count]
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=_DATA["group"])
    gathered = value.new_empty((total,) + tuple(value.shape[1:]))
    for r, (part, share) in enumerate(zip(parts, shares)):
        gathered[r::world] = part[:share]
    return gathered


def device():
    """Where this job's collectives take their tensors: the current CUDA device under NCCL, else the CPU."""
    return _device()


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


#: torch's global random state, for :func:`~distkeras.backends.policies.random_states`.
TORCH_RANDOM = (torch.get_rng_state, torch.set_rng_state)


def broadcast_bytes(data):
    """Rank 0's ``data`` (bytes) on every rank (collective)."""
    box = [data]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def sync_random_state():
    """Every rank takes rank 0's state of Python's, NumPy's and torch's global random generators
    (:func:`~distkeras.backends.policies.sync_random_state` over torch.distributed)."""
    policies.sync_random_state(broadcast_bytes, TORCH_RANDOM)
