"""How the processes of a job are started and find each other: everything ``distkeras launch`` runs, and the parts
of it a backend's engine uses to start.

- :mod:`~distkeras.launch.command`: the ``distkeras launch`` command itself: plan the job, start this host's
  workers with the variables their engine reads (:func:`~distkeras.launch.command.worker_env`), watch them, stop
  them all when one fails.
- :mod:`~distkeras.launch.rendezvous`: the launchers of a job of several hosts meet at node 0 and agree on the plan.
- :mod:`~distkeras.launch.wire`: what the launchers say to each other: bounded JSON lines, numbered and signed, every
  field of every message checked by type and charset.
- :mod:`~distkeras.launch.relay`: every worker's output on the launcher's stdout, prefixed with its rank.
- :mod:`~distkeras.launch.processes`: what the launcher and a backend's own launch share: exit 75 for a
  preempted worker, workers that die with their parent, how a process ended.
- :mod:`~distkeras.launch.network`: the address and interface that reach the coordinator; free ports.
- :mod:`~distkeras.launch.exchange`: the engines' coordinator address passed through torchrun's store.

The backends import the last four (never :mod:`~distkeras.launch.command`, which imports the backends). This
``__init__`` imports only those, so ``import distkeras.launch.network`` stays cheap and free of the command.
Exported here: :data:`EXIT_PREEMPTED`, :data:`LAUNCHER_ENV`, :data:`INTERFACE_ENV`, :func:`free_port` and
:func:`parse_address`. Part of the Python 3.6-compatible core.
"""

from .network import INTERFACE_ENV, free_port, parse_address
from .processes import EXIT_PREEMPTED, LAUNCHER_ENV

__all__ = ["EXIT_PREEMPTED", "INTERFACE_ENV", "LAUNCHER_ENV", "free_port", "parse_address"]
