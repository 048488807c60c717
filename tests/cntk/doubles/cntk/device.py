"""``cntk.device``: the one device this process computes on."""

import os


class DeviceDescriptor(object):
    """``cntk.device.DeviceDescriptor``: ``type()`` is 0 for the CPU and 1 for a GPU (``DeviceKind``), ``id()`` its index."""

    def __init__(self, kind, index):
        self._kind, self._index = kind, index

    def type(self):
        return self._kind

    def id(self):
        return self._index


def use_default_device():
    """``cntk.device.use_default_device()``: the CPU here, or GPU <n> when ``FAKE_CNTK_GPU=<n>`` is set."""
    gpu = os.environ.get("FAKE_CNTK_GPU")
    return DeviceDescriptor(1, int(gpu)) if gpu else DeviceDescriptor(0, 0)
