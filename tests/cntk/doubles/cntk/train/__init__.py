"""``cntk.train``: the Trainer and the distributed learners."""

from . import distributed, trainer
from .trainer import Trainer
