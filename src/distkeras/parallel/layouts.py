"""Model parallelism's one layout API, written once for every backend that splits variables (JAX, PyTorch).

A layout says, for each variable, which of its axes is split over which axis of the device mesh: a 2-D mesh
``batch`` x ``model`` of ``replicas`` x ``model_shards`` devices (or processes). The user gives it as Keras
does, ``layout_map``: a ``keras.distribution.LayoutMap`` or a plain dict from a variable path regex to axes,
``{"dense_1/kernel": (None, "model")}``, each key matched as ``LayoutMap.__getitem__`` matches it (the exact
path first, else every key as a ``re.fullmatch`` pattern; two matching keys are an error). KerasHub's
``backbone.get_layout_map(mesh)`` gives one too.

What the backends do with it differs (JAX hands it to Keras' ``ModelParallel``, which lets XLA's GSPMD place
the collectives; PyTorch splits layers Megatron-style, :mod:`distkeras.backends.torch.tensor`); what doesn't
is here, in plain Python over ``(path, shape)`` pairs: reading the options, the axes each variable gets, the
checks with errors that name the variable, and the default layout when none is given.

Pure, framework-free, Python 3.6-compatible.
"""

import re
from typing import Dict, Mapping, NamedTuple, Optional, Sequence, Tuple

from ..errors import OptionError

BATCH = "batch"
MODEL = "model"
AXES = (BATCH, MODEL)

Axes = Tuple[Optional[str], ...]


class Mesh(NamedTuple):
    """The device mesh: ``replicas`` along ``batch`` times ``model_shards`` along ``model``."""

    replicas: int
    model_shards: int

    @property
    def size(self) -> int:
        return self.replicas * self.model_shards

    def axis_size(self, name: Optional[str]) -> int:
        return {BATCH: self.replicas, MODEL: self.model_shards}.get(name, 1)  # type: ignore


def mesh(devices: int, model_shards: Optional[int]) -> Mesh:
    """The mesh of ``devices`` devices with ``model_shards`` of them on the ``model`` axis (default: all).

    Raises:
        OptionError: ``model_shards`` is not a positive int that divides ``devices``.
    """
    shards = devices if model_shards is None else model_shards
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1 or devices % shards:
        raise OptionError("Expected model_shards to be a positive int that divides the {} devices. Received: "
                          "model_shards={!r}".format(devices, model_shards))
    return Mesh(devices // shards, shards)


def rules(layout_map: object) -> Dict[str, Axes]:
    """``layout_map`` (a dict, or anything with ``items()`` such as Keras' ``LayoutMap``, whose values may be
    ``TensorLayout`` objects with ``axes``) as ``{key: axes}``.

    Raises:
        OptionError: not a mapping, a key that is not a valid regex, or axes that are not a sequence of
            ``None``, ``"batch"`` and ``"model"`` (each mesh axis at most once).
    """
    if isinstance(layout_map, (str, bytes)) or not callable(getattr(layout_map, "items", None)):
        raise OptionError("Expected layout_map to be a dict (or keras.distribution.LayoutMap) from variable path regex "
                          "to axes, e.g. {{'.*dense.*kernel': (None, 'model')}}. Received: layout_map={!r}".format(
                              layout_map))
    out: Dict[str, Axes] = {}
    for key, value in layout_map.items():  # type: ignore
        axes = getattr(value, "axes", value)
        if not isinstance(key, str):
            raise OptionError("Expected layout_map's keys to be variable path regexes. Received: {!r}".format(key))
        try:
            re.compile(key)
        except re.error as exc:
            raise OptionError("layout_map key {!r} is not a regex: {}".format(key, exc))
        if not isinstance(axes, (list, tuple)) or not all(a is None or a in AXES for a in axes):
            raise OptionError("Expected layout_map[{!r}] to be axes: a tuple of None, 'batch' and 'model', one per "
                              "axis of the variable. Received: {!r}".format(key, axes))
        named = [a for a in axes if a is not None]
        if len(set(named)) != len(named):
            raise OptionError("layout_map[{!r}] names a mesh axis twice: {!r}".format(key, tuple(axes)))
        out[key] = tuple(axes)
    return out


def axes_of(path: str, table: Mapping[str, Axes]) -> Optional[Axes]:
    """The axes of the variable at ``path``, matched as Keras' ``LayoutMap`` matches: the exact key, else the one
    key that ``re.fullmatch``-es it; None where none does.

    Raises:
        OptionError: two keys match ``path``.
    """
    if path in table:
        return table[path]
    matching = [key for key in table if re.fullmatch(key, path)]
    if len(matching) > 1:
        raise OptionError("Variable {} matches more than one layout_map key: {}. Make every variable match at most "
                          "one key.".format(path, ", ".join(map(repr, matching))))
    return table[matching[0]] if matching else None


def assign(variables: Sequence[Tuple[str, Tuple[int, ...]]], table: Mapping[str, Axes],
           grid: Mesh) -> Dict[str, Axes]:
    """Every variable's axes (``variables``: ``(path, shape)`` pairs): only those the table gives, checked.

    Raises:
        OptionError: a matched layout has another rank than its variable, a mesh axis doesn't divide the axis
            it splits, or a key matches no variable (the message lists the model's variables).
    """
    out: Dict[str, Axes] = {}
    used = set()
    for path, shape in variables:
        axes = axes_of(path, table)
        if axes is None:
            continue
        used.update(key for key in table if key == path or re.fullmatch(key, path))
        if len(axes) != len(shape):
            raise OptionError("Expected {} axes for {} of shape {}. Received: layout {}".format(
                len(shape), path, tuple(shape), axes))
        for size, axis in zip(shape, axes):
            if axis is not None and size % grid.axis_size(axis):
                raise OptionError("Expected the '{}' axis ({} devices) to divide {} of shape {}. Received: layout "
                                  "{}".format(axis, grid.axis_size(axis), path, tuple(shape), axes))
        out[path] = axes
    unused = [key for key in table if key not in used]
    if unused:
        raise OptionError("layout_map key(s) {} match no variable. The model's variables: {}".format(
            ", ".join(map(repr, unused)), ", ".join(path for path, _ in variables)))
    return out


def default_rules(variables: Sequence[Tuple[str, Tuple[int, ...]]], shards: int, model_name: str = "the model") \
        -> Dict[str, Axes]:
    """The layout when none is given: every kernel and embedding table split along its last axis over
    ``model`` (a column split), where ``shards`` divides it.

    Raises:
        OptionError: nothing can be split that way.
    """
    out: Dict[str, Axes] = {}
    for path, shape in variables:
        if path.rpartition("/")[2] in ("kernel", "embeddings") and len(shape) >= 2 and shape[-1] % shards == 0:
            out[re.escape(path)] = (None,) * (len(shape) - 1) + (MODEL,)
    if not out:
        raise OptionError(
            "strategy='model' found nothing to shard: no kernel or embedding table of {} has a last axis divisible "
            "by model_shards={}. Pass layout_map={{path regex: axes}}, another model_shards, or use "
            "strategy='data'.".format(model_name, shards))
    return out


def model_axis(axes: Optional[Axes]) -> Optional[int]:
    """The index of the variable axis split over ``model`` (None: not split over it)."""
    if axes is None:
        return None
    for i, axis in enumerate(axes):
        if axis == MODEL:
            return i
    return None


def describe(grid: Mesh) -> Dict[str, int]:
    """What ``describe()`` reports of the mesh: ``replicas`` (the batch axis) and ``model_shards``."""
    return {"replicas": grid.replicas, "model_shards": grid.model_shards}

