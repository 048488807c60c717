"""Random draws in a distributed step: each rank draws what one device draws for its rows of the global batch.

Every rank runs the same step on its rows ``[rank::world]`` of the global batch, and Keras' random state
is equal on every rank (seed generators are model variables, broadcast from rank 0; torch's global
generator is rank 0's from the start of every epoch). Left alone, the ranks would draw alike for their
different rows: rank 1's dropout mask would be rank 0's, not the one one device draws for rank 1's rows.

While a distributed train, test or predict step runs (:func:`global_draws`), the functions of Keras'
torch random module (``keras.src.backend.torch.random``, a Keras private: ``keras.random.*``, the layers'
``backend.random`` and the preprocessing layers' ``self.backend.random`` all call through its attributes,
so the attributes are swapped for the step and put back after it) take a draw whose leading dimension is
this rank's row count as a draw over the batch:

- **Exact** (the value one device draws for these rows): ``normal``, ``uniform``, ``truncated_normal``,
  ``randint`` (and so ``keras.random.*``, ``GaussianNoise``, ``GaussianDropout``, ``AlphaDropout``, the
  Keras VAE example's ``Sampling`` layer, augmentation layers such as ``RandomFlip``, which draw one value
  per image), ``dropout`` (``Dropout``, ``SpatialDropout*``: the mask is drawn for the global batch's
  shape, seeded or from torch's global generator, and this rank keeps its rows), ``gamma``, ``binomial``
  and ``beta`` with parameters alike for every row, and ``shuffle`` along an axis other than the batch.
  Each rank draws the global batch's shape with the same seed and keeps its rows, so every generator
  advances exactly as on one device and the next draw is exact too (each rank draws ``world`` times the
  numbers it keeps).
- **Independent, not exact**: ``categorical`` on per-row logits, ``gamma``/``binomial``/``beta`` with
  per-row parameters, and ``shuffle`` of the batch axis itself, which one device computes from every
  rank's rows. Each rank draws with its own seed (the step's seed and its rank), without changing any
  generator's state, so no two ranks draw alike.
- Every other draw (a shape without this rank's row count first: a weight initializer, a draw per
  feature) is left as it is, the same on every rank, as one device draws it once. A draw of two or more
  dimensions whose leading dimension is 2 to 4 times the rank's rows (two rows or more) is taken for that
  many batches stacked, as the Keras GAN examples' label noise over ``concatenate([generated, real])``:
  each rank keeps its rows of each. A draw whose leading dimension matches by coincidence, without being
  per-row, is taken for a per-row one.

A rank with no rows in a step (a stand-in sample, weight zero) draws the global shape as well, so its
generators stay in step with the other ranks'. The functions are swapped in the module, for the process:
another thread drawing while a step runs draws through them too (for its own shapes, which are rarely this
rank's row count).
"""

import contextlib
import importlib
import threading

import torch

#: Keras' torch random module (a private: the one place its torch backend draws random numbers).
_PRIVATE_MODULE = "keras.src.backend.torch.random"
#: The functions that take a ``shape`` first, drawn at the global shape and sliced.
SHAPED = ("normal", "uniform", "truncated_normal", "randint")
#: The functions that take a ``shape`` and parameters broadcast to it.
PARAMETRIZED = {"gamma": ("alpha",), "binomial": ("counts", "probabilities"), "beta": ("alpha", "beta")}
#: Every function :func:`global_draws` replaces.
PATCHED = SHAPED + tuple(PARAMETRIZED) + ("dropout", "shuffle", "categorical")
#: The most batches a draw may stack (see :class:`_Rows`).
MAX_BLOCKS = 4

_state = threading.local()


class _Rows(object):
    """This rank's rows of a global batch of ``total``: ``local`` rows, ``keep`` the slice of the global draw.

    A draw may also be ``k`` batches stacked (``k`` times this rank's rows, as the Keras GAN examples' label
    noise over ``concatenate([generated, real])``): it is drawn as ``k`` global batches, and this rank keeps
    its rows of each. Taken so only where that can't be a draw of another shape by chance as easily: at least
    two rows here, a draw of two dimensions or more, ``k`` up to :data:`MAX_BLOCKS`.
    """

    def __init__(self, rank, world, count, total, keep=None):
        self.rank, self.world, self.count = rank, world, count
        self.total = max(int(total), 1)
        self.local = count if count else 1  # a stand-in step runs on one sample
        self.keep = slice(rank, None, world) if count else slice(0, 1)
        if keep is not None:  # a pipeline's micro-batch: rows keep of the global batch
            self.keep = keep

    def blocks(self, shape):
        """How many of this rank's batches the draw's leading dimension stacks (0: not a draw over rows)."""
        try:
            lead = int(shape[0]) if len(shape) > 0 else 0
        except (TypeError, ValueError):
            return 0
        if not lead or self.local == self.total:
            return 0
        if lead == self.local:
            return 1
        k, rest = divmod(lead, self.local)
        if not rest and self.count >= 2 and len(shape) >= 2 and 2 <= k <= MAX_BLOCKS:
            return k
        return 0

    def per_row(self, shape):
        return self.blocks(shape) > 0

    def global_shape(self, shape):
        return (self.blocks(shape) * self.total,) + tuple(int(d) for d in shape[1:])

    def rows_of(self, value, blocks):
        """This rank's rows of each of the ``blocks`` global batches stacked in ``value``."""
        if blocks == 1:
            return value[self.keep].contiguous()
        return torch.cat([value[b * self.total:(b + 1) * self.total][self.keep] for b in range(blocks)]).contiguous()


def _module():
    return importlib.import_module(_PRIVATE_MODULE)


def _symbolic(module):
    return module.get_device() == "meta"


def _rank_seed(module, seed, rank):
    """An int seed for an independent draw of ``rank``: the step's seed drawn once (as the draw itself
    would, so seed generators advance as on one device) and the rank folded in."""
    first, second = (int(s) for s in module.draw_seed(seed))
    return (first * 1000003 + second + 7919 * (rank + 1)) & 0x7FFFFFFF


def _rows_of(value, rows, shape):
    return rows.rows_of(value, rows.blocks(shape))


def _shaped(module, original, rows):
    def draw(shape, *args, **kwargs):
        if _symbolic(module) or not rows.per_row(shape):
            return original(shape, *args, **kwargs)
        return _rows_of(original(rows.global_shape(shape), *args, **kwargs), rows, shape)

    return draw


def _parametrized(module, original, rows, names):
    def draw(shape, *args, **kwargs):
        if _symbolic(module) or not rows.per_row(shape):
            return original(shape, *args, **kwargs)
        target = rows.global_shape(shape)
        values = list(args[: len(names)]) + [kwargs[n] for n in names[len(args):] if n in kwargs]
        try:
            for value in values:
                torch.broadcast_shapes(tuple(torch.as_tensor(value).shape), target)
        except RuntimeError:  # per-row parameters: the other ranks' rows are unknown here
            seed = kwargs.pop("seed", None)
            return original(shape, *args, seed=_rank_seed(module, seed, rows.rank), **kwargs)
        return _rows_of(original(target, *args, **kwargs), rows, shape)

    return draw


def _ones_like_layout(inputs, shape):
    """Ones of ``shape`` whose dimensions lie in memory in the order ``inputs``' do (outermost first, by stride)."""
    order = sorted(range(inputs.dim()), key=lambda d: (-inputs.stride(d), d))
    ones = torch.ones([shape[d] for d in order], dtype=inputs.dtype, device=inputs.device)
    return ones.permute([order.index(d) for d in range(inputs.dim())])


def _dropout(module, original, rows):
    def dropout(inputs, rate, noise_shape=None, seed=None):
        if _symbolic(module) or not rows.per_row(inputs.shape) or rate in (0.0, 1.0):
            return original(inputs, rate, noise_shape=noise_shape, seed=seed)
        # The mask one device draws for the global batch (ones through Keras' own dropout: the seeded path
        # or torch's, whichever Keras takes), then this rank's rows of it. The ones are laid out in memory as
        # ``inputs`` is: torch's unseeded dropout fills its mask in memory order (``empty_like``), and a
        # strided Conv1D's output is a permuted view, whose mask one device draws in that order.
        ones = _ones_like_layout(inputs, rows.global_shape(inputs.shape))
        mask = original(ones, rate, noise_shape=noise_shape, seed=seed)
        return inputs * _rows_of(mask, rows, inputs.shape)

    return dropout


def _shuffle(module, original, rows):
    def shuffle(x, axis=0, seed=None):
        x = module.convert_to_tensor(x)
        if _symbolic(module) or not rows.per_row(x.shape):
            return original(x, axis=axis, seed=seed)
        if axis % x.ndim == 0:  # a permutation of the global batch: independent only
            return original(x, axis=axis, seed=_rank_seed(module, seed, rows.rank))
        axis = axis % x.ndim
        # The global batch's permutation indices (Keras' own shuffle of an index table), this rank's rows.
        size = x.shape[axis]
        shape = [1] * (axis + 1)
        shape[axis] = size
        table = torch.arange(size, device=x.device).reshape(shape).expand(rows.global_shape(x.shape[: axis + 1]))
        order = _rows_of(original(table, axis=axis, seed=seed), rows, x.shape)
        for _ in range(x.ndim - axis - 1):
            order = order.unsqueeze(-1)
        return x.gather(axis, order.expand(x.shape))

    return shuffle


def _categorical(module, original, rows):
    def categorical(logits, num_samples, dtype="int32", seed=None):
        logits = module.convert_to_tensor(logits)
        if _symbolic(module) or logits.ndim < 2 or not rows.per_row(logits.shape):
            return original(logits, num_samples, dtype=dtype, seed=seed)
        return original(logits, num_samples, dtype=dtype, seed=_rank_seed(module, seed, rows.rank))

    return categorical


@contextlib.contextmanager
def global_draws(rank, world, count, total, rows=None):
    """While open, Keras' torch random functions draw for this rank's rows of the global batch (see the
    module docstring). ``count``: this rank's rows in the step (0: a stand-in), ``total``: the global
    batch's. Nested blocks leave the outer one in place, except one given ``rows``: a pipeline's micro-batch,
    rows ``rows`` (a slice) of what the outer block keeps (or of the global batch, with no outer block)."""
    if rows is not None and getattr(_state, "open", False):
        outer = _state.rows
        saved = (outer.keep, outer.local, outer.count)
        kept = torch.arange(outer.total)[outer.keep][rows]
        outer.keep, outer.local, outer.count = kept, int(kept.numel()), int(kept.numel())
        try:
            yield
        finally:
            outer.keep, outer.local, outer.count = saved
        return
    if getattr(_state, "open", False) or (world < 2 and rows is None) or total is None:
        yield
        return
    module = _module()
    originals = {name: getattr(module, name) for name in PATCHED}
    rows = _Rows(rank, world, count, total, keep=rows)
    _state.rows = rows
    patched = {name: _shaped(module, originals[name], rows) for name in SHAPED}
    patched.update({name: _parametrized(module, originals[name], rows, PARAMETRIZED[name]) for name in PARAMETRIZED})
    patched["dropout"] = _dropout(module, originals["dropout"], rows)
    patched["shuffle"] = _shuffle(module, originals["shuffle"], rows)
    patched["categorical"] = _categorical(module, originals["categorical"], rows)
    _state.open = True
    for name, function in patched.items():
        setattr(module, name, function)
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(module, name, function)
        _state.open = False
