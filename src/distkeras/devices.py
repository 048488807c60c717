"""Device specs: parse what the user typed, validate it against what exists.

Pure Python, no framework import: the adapter reports the devices that exist (``available``) and
:func:`parse` resolves the user's spec against them, so every rule here is tested without a GPU.
Part of the Python 3.6-compatible core.

Accepted specs (``devices=`` of :func:`distkeras.distribute`):

- ``None`` or ``"auto"``: every accelerator, or every CPU device when there is no accelerator.
- an int ``N``: the first N accelerators, or the first N CPU devices when there is no accelerator.
- a list of ints: accelerator ids, ``[0, 2]``.
- a string or a list of strings: ``"gpu:0"``, ``"GPU:0"``, ``"/gpu:0"``, ``"/device:GPU:0"``,
  ``"/job:localhost/replica:0/task:0/device:GPU:0"``, ``"cuda:0"``, ``"gpu(0)"`` (MXNet's spelling),
  ``"cpu:1"``; a bare kind (``"gpu"``, ``"cpu"``) means every device of that kind.
"""

import re
import typing
from typing import List, Sequence

from .errors import DeviceSpecError

#: The environment variable that splits the host CPU into N devices (read at ``import distkeras``).
CPU_DEVICES_ENV = "DISTKERAS_CPU_DEVICES"

#: Device kinds distkeras knows, and the spellings that map onto them.
KINDS = ("cpu", "gpu", "tpu")
_ALIASES = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "tpu": "tpu"}

_SPEC = re.compile(
    r"^/?(?:job:[^/]+/)?(?:replica:\d+/)?(?:task:\d+/)?(?:device:)?"
    r"(?P<kind>[A-Za-z_]+)(?:[:(](?P<index>\d+)\)?)?$"
)


class Device(typing.NamedTuple("Device", [("kind", str), ("index", int)])):
    """One device: a kind (``"cpu"``, ``"gpu"``, ``"tpu"``) and an index among devices of that kind."""

    __slots__ = ()

    def __str__(self):
        return "{}:{}".format(self.kind, self.index)

    @property
    def is_accelerator(self):
        """True for GPUs and TPUs."""
        return self.kind != "cpu"


def _names(devices):
    return ", ".join(str(d) for d in devices) if devices else "(none)"


def _hint_cpu(count):
    return (
        "To train on {n} CPU devices of this machine, set DISTKERAS_CPU_DEVICES={n} in the "
        "environment or call distkeras.use_cpu_devices({n}) before the backend starts.".format(n=count)
    )


def parse_one(text):
    """Parse one device string such as ``"/device:GPU:0"`` into a :class:`Device` or a bare kind.

    Args:
        text: the device string.

    Returns:
        A :class:`Device`, or the kind as a string (``"gpu"``) when the text names no index.

    Raises:
        DeviceSpecError: the text is not a device spec or names an unknown kind.
    """
    match = _SPEC.match(text.strip())
    if not match:
        raise DeviceSpecError(
            "Expected a device such as 'gpu:0', '/device:GPU:0' or 'cpu:1'. Received: devices={!r}".format(text)
        )
    kind = _ALIASES.get(match.group("kind").lower())
    if kind is None:
        raise DeviceSpecError(
            "Unknown device kind {!r} in devices={!r}. Known kinds: {}.".format(
                match.group("kind"), text, ", ".join(KINDS)
            )
        )
    if match.group("index") is None:
        return kind
    return Device(kind, int(match.group("index")))


def _default(available):
    accelerators = [d for d in available if d.is_accelerator]
    return accelerators or [d for d in available if d.kind == "cpu"]


def _first_n(count, available):
    if count <= 0:
        raise DeviceSpecError(
            "Expected a positive number of devices. Received: devices={}. Pass devices=None to use "
            "every device of this machine ({}).".format(count, _names(_default(available)))
        )
    pool = _default(available)
    if count > len(pool):
        hint = _hint_cpu(count) if not any(d.is_accelerator for d in available) else (
            "Ask for at most {} devices.".format(len(pool))
        )
        raise DeviceSpecError(
            "You requested {} devices; this machine has {}: {}. {}".format(count, len(pool), _names(pool), hint)
        )
    return list(pool[:count])


def _from_item(item, available):
    """One list element -> a list of Device (a bare kind expands to every device of that kind)."""
    if isinstance(item, bool):
        raise DeviceSpecError("Expected a device id or a device string. Received: {!r}".format(item))
    if isinstance(item, int):
        if item < 0:
            raise DeviceSpecError("Expected a device id >= 0. Received: devices=[..., {}, ...]".format(item))
        accelerators = [d for d in available if d.is_accelerator]
        kind = accelerators[0].kind if accelerators else "gpu"
        return [Device(kind, item)]
    if isinstance(item, Device):
        return [item]
    if isinstance(item, str):
        parsed = parse_one(item)
        if isinstance(parsed, Device):
            return [parsed]
        of_kind = [d for d in available if d.kind == parsed]
        if not of_kind:
            raise DeviceSpecError(
                "You requested every {k} device; this machine has no {k} device (it has: {}).".format(
                    _names(available), k=parsed
                )
            )
        return of_kind
    raise DeviceSpecError(
        "Expected a device id (int) or a device string such as 'gpu:0'. Received: {!r} of type {}".format(
            item, type(item).__name__
        )
    )


def parse(spec: object, available: Sequence[Device]) -> List[Device]:
    """Resolve a user's device spec against the devices that exist.

    Args:
        spec: ``None``, ``"auto"``, an int, a device string, or a list of ints/strings/Devices.
        available: the devices the active backend reports, in its order.

    Returns:
        The list of devices to replicate over, in the order given (``None``/int: backend order).

    Raises:
        DeviceSpecError: for 0 or negative counts, an empty list, duplicates, an unknown kind, a
            device that isn't present, or mixed device kinds. The message lists what exists.

    Examples:
        >>> parse(["/gpu:1", 0], [Device("gpu", 0), Device("gpu", 1)])
        [Device(kind='gpu', index=1), Device(kind='gpu', index=0)]
    """
    available = list(available)
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == "auto"):
        chosen = _default(available)
        if not chosen:
            raise DeviceSpecError("The backend reports no device at all; nothing to distribute over.")
        return chosen
    if isinstance(spec, bool):
        raise DeviceSpecError("Expected None, 'auto', an int or a list of devices. Received: devices={!r}".format(spec))
    if isinstance(spec, int):
        return _first_n(spec, available)
    if isinstance(spec, (str, Device)):
        spec = [spec]
    if not isinstance(spec, (list, tuple, range)):
        raise DeviceSpecError(
            "Expected None, 'auto', an int, a device string or a list of devices. Received: devices={!r} "
            "of type {}".format(spec, type(spec).__name__)
        )
    items = list(spec)
    if not items:
        raise DeviceSpecError(
            "Expected at least one device. Received: devices=[]. Pass devices=None to use every device "
            "of this machine ({}).".format(_names(_default(available)))
        )
    chosen: List[Device] = []
    for item in items:
        chosen.extend(_from_item(item, available))
    seen = set()
    duplicates = []
    for device in chosen:
        if device in seen and device not in duplicates:
            duplicates.append(device)
        seen.add(device)
    if duplicates:
        raise DeviceSpecError(
            "Each device may be listed once. Received duplicates: {} (in devices={!r}).".format(
                _names(duplicates), spec
            )
        )
    missing = [d for d in chosen if d not in available]
    if missing:
        kinds = sorted(set(d.kind for d in missing))
        hint = _hint_cpu(max(d.index for d in missing) + 1) if kinds == ["cpu"] else (
            "Pick devices from that list, or pass devices=None for all of them."
        )
        raise DeviceSpecError(
            "You requested {}; this machine has: {}. {}".format(_names(missing), _names(available), hint)
        )
    kinds = sorted(set(d.kind for d in chosen))
    if len(kinds) > 1:
        raise DeviceSpecError(
            "Data-parallel replicas must be devices of one kind. Received a mix of {} ({}). Pick one kind: "
            "the slowest device would pace every step.".format(" and ".join(kinds), _names(chosen))
        )
    return chosen

