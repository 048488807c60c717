"""Stand-in for Keras 2.3.1 with the CNTK backend (see ../README.md): what distkeras' CNTK adapter touches."""

from . import backend, layers, models, optimizers

__version__ = "2.3.1"
