"""Slurm: the tasks of a job step that ``srun`` started, with no launcher in between.

    srun --nodes 2 --ntasks-per-node 4 python train.py         # 8 workers, one per task

Every task of the step is one worker: its rank is ``SLURM_PROCID``, the world the step's tasks
(``SLURM_STEP_NUM_TASKS``), its local rank ``SLURM_LOCALID`` and its host's workers the step's share of that
node (``SLURM_STEP_TASKS_PER_NODE``, in Slurm's ``2(x3),1`` notation). The hosts are ``SLURM_STEP_NODELIST``
(else ``SLURM_JOB_NODELIST``), expanded by :func:`expand_hostlist` as ``scontrol show hostnames`` does.

- The coordinator (torch's TCPStore, jax.distributed's service) is the step's first node, on
  :func:`coordinator_port`: ``DISTKERAS_COORDINATOR_PORT`` where set, else a port derived from the job id, the
  step id and the requeue count, in 20000..29999.
- TensorFlow's workers (TF_CONFIG) are ``<node>:<port + 1 + local rank>``, one per task, in rank order: the
  tasks' placement follows ``SLURM_DISTRIBUTION`` (``block``, Slurm's default, ``cyclic`` or ``plane=N``);
  an arbitrary placement is refused, as is a task whose node and local rank disagree with the placement.
- A process of the job that is no task of a step (the batch script itself, an ``salloc`` shell) while the job
  has more than one task is an error, not a job of one: only ``srun`` starts the tasks.

Slurm is a scheduler (``launcher = False``): under ``srun ... distkeras launch`` (or torchrun) the launcher's
variables describe the workers, and Slurm's the launchers (:func:`launch_arguments`).
Pure Python, part of the Python 3.6-compatible core.
"""

import re
from typing import Dict, List, Mapping, Optional, Tuple

from ..cluster.record import Cluster
from ..errors import ClusterError
from .base import Environment

#: Overrides the port :func:`coordinator_port` derives.
PORT_ENV = "DISTKERAS_COORDINATOR_PORT"
#: The ports :func:`coordinator_port` derives: FIRST_PORT + SLOT_SIZE * slot, slot in 0..SLOTS-1.
FIRST_PORT = 20000
SLOT_SIZE = 16
SLOTS = 625  # 20000 .. 29999: below Linux's ephemeral ports (32768 ..), away from the well-known ones

_STEP_VARIABLES = ("SLURM_STEP_ID", "SLURM_STEPID")
#: A hostlist naming more hosts is a mistake, not a cluster (the largest machines have tens of thousands of nodes);
#: :func:`count_hostlist` tells before anything is expanded.
MAX_HOSTS = 100000


def _hostlist_error(text, why):
    return ClusterError(
        "Expected a Slurm hostlist such as 'gpu-a[01-04,07],gpu-b3' ({}). Received: {!r}".format(why, text))


def _split_top(text: str) -> List[str]:
    """Split at commas and white space outside brackets."""
    items, depth, current = [], 0, []  # type: ignore
    for char in text:
        if char == "[":
            depth += 1
            if depth > 1:
                raise _hostlist_error(text, "brackets don't nest")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise _hostlist_error(text, "a ']' without its '['")
        if depth == 0 and (char == "," or char.isspace()):
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise _hostlist_error(text, "a '[' without its ']'")
    items.append("".join(current))
    return [item for item in items if item]


def _expand_range(text: str, part: str) -> List[str]:
    """``"01-04"`` -> ``["01", "02", "03", "04"]``: zero-padded to the width of the first bound, as Slurm does."""
    low, sep, high = part.partition("-")
    if not low.isdigit() or (sep and not high.isdigit()):
        raise _hostlist_error(text, "{!r} is no number or range of numbers".format(part))
    if not sep:
        return [low]
    first, last = int(low), int(high)
    if last < first:
        raise _hostlist_error(text, "the range {!r} runs backwards".format(part))
    return [str(n).zfill(len(low)) for n in range(first, last + 1)]


def _range_length(text: str, part: str) -> int:
    """How many numbers ``"01-04"`` names (4), checked as :func:`_expand_range` checks it, without expanding."""
    low, sep, high = part.partition("-")
    if not low.isdigit() or (sep and not high.isdigit()):
        raise _hostlist_error(text, "{!r} is no number or range of numbers".format(part))
    if not sep:
        return 1
    if int(high) < int(low):
        raise _hostlist_error(text, "the range {!r} runs backwards".format(part))
    return int(high) - int(low) + 1


def _groups(item: str) -> List[str]:
    """An item's literal pieces and bracket groups, in order."""
    return re.split(r"(\[[^\[\]]*\])", item)


def _group_parts(text: str, piece: str) -> List[str]:
    parts = [part.strip() for part in piece[1:-1].split(",") if part.strip()]
    if not parts:
        raise _hostlist_error(text, "an empty bracket group")
    return parts


def count_hostlist(text: str) -> int:
    """How many hosts :func:`expand_hostlist` would list, computed from the ranges' bounds (no expansion: a
    mistyped ``n[0-9999999]`` costs microseconds, not seconds and hundreds of MB).

    Example:
        >>> count_hostlist("gpu-a[01-04,07],gpu-b3")
        6

    Raises:
        ClusterError: a malformed hostlist, as :func:`expand_hostlist` says.
    """
    total = 0
    for item in _split_top(text.strip()):
        count = 1
        for piece in _groups(item):
            if piece.startswith("["):
                count *= sum(_range_length(text, part) for part in _group_parts(text, piece))
        total += count
    return total


def expand_hostlist(text: str) -> List[str]:
    """Every host of a Slurm hostlist, in its order, as ``scontrol show hostnames`` lists them.

    Comma- (or space-) separated items; each item is literal text with bracket groups of numbers and
    ranges (``[01-04,07]``, zero padding kept, the width of a range's first bound). Several groups in one item
    give every combination, the last group varying fastest (``a[1-2]b[3-4]`` -> ``a1b3 a1b4 a2b3 a2b4``).
    Duplicates are kept, as Slurm keeps them.

    Example:
        >>> expand_hostlist("gpu-a[01-04,07],gpu-b3")
        ['gpu-a01', 'gpu-a02', 'gpu-a03', 'gpu-a04', 'gpu-a07', 'gpu-b3']

    Raises:
        ClusterError: unbalanced or nested brackets, an empty group, a bound that is no number, a backwards range,
            more than :data:`MAX_HOSTS` hosts (counted before expanding).
    """
    count = count_hostlist(text)
    if count > MAX_HOSTS:
        raise _hostlist_error(text, "it names {} hosts, more than the {} distkeras accepts: check the brackets' "
                                    "bounds".format(count, MAX_HOSTS))
    hosts: List[str] = []
    for item in _split_top(text.strip()):
        names = [""]
        for piece in _groups(item):
            if not piece.startswith("["):
                names = [name + piece for name in names]
                continue
            values = [value for part in _group_parts(text, piece) for value in _expand_range(text, part)]
            names = [name + value for name in names for value in values]
        hosts.extend(names)
    return hosts


def expand_tasks_per_node(text: str) -> List[int]:
    """Slurm's per-node counts: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Raises:
        ClusterError: anything else.
    """
    counts: List[int] = []
    for part in text.strip().split(","):
        match = re.match(r"^\s*(\d+)\s*(?:\(x(\d+)\))?\s*$", part)
        if not match:
            raise ClusterError(
                "Expected Slurm's tasks per node such as '2(x3),1'. Received: {!r}".format(text))
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def placement(tasks_per_node: List[int], distribution: str = "block") -> List[Tuple[int, int]]:
    """``(node index, local rank)`` of every rank, in rank order, for Slurm's task distribution over nodes.

    Args:
        tasks_per_node: the step's tasks on each node, in node order.
        distribution: ``SLURM_DISTRIBUTION`` (its node part, before ``:``): ``block`` (Slurm's default: a
            node's tasks are consecutive ranks), ``cyclic`` (round robin over the nodes with tasks left) or
            ``plane=N`` (blocks of N, round robin).

    Raises:
        ClusterError: an arbitrary or unknown distribution (distkeras can't tell which rank runs where).
    """
    kind = (distribution or "block").split(":")[0].strip().lower() or "block"
    if kind == "block":
        block: int = 0
    elif kind == "cyclic":
        block = 1
    elif re.match(r"^plane=\d+$", kind) and int(kind.split("=")[1]) > 0:
        block = int(kind.split("=")[1])
    else:
        raise ClusterError(
            "Expected SLURM_DISTRIBUTION block, cyclic or plane=N: distkeras derives from it which rank runs on "
            "which node. Received: SLURM_DISTRIBUTION={!r}. Start the step with `srun --distribution=block`, or "
            "use `srun --ntasks-per-node=1 distkeras launch --nproc-per-node N`.".format(distribution))
    left = list(tasks_per_node)
    placed = [0] * len(left)
    ranks: List[Tuple[int, int]] = []
    while any(left):
        for node in range(len(left)):
            take = left[node] if block == 0 else min(block, left[node])
            for _ in range(take):
                ranks.append((node, placed[node]))
                placed[node] += 1
            left[node] -= take
    return ranks


def coordinator_port(env: Mapping[str, str]) -> int:
    """The port of the job's coordinator: ``DISTKERAS_COORDINATOR_PORT`` where set, else derived.

    Derived: ``20000 + 16 * ((97 * SLURM_JOB_ID + 13 * SLURM_RESTART_COUNT + SLURM_STEP_ID) % 625)``, in
    20000..29984. Successive steps of a job, and a requeued job (same job id, steps counted from 0 again,
    ``SLURM_RESTART_COUNT`` one more), get different ports, so a step never meets the sockets its predecessor
    left; the 16 ports of a slot hold the coordinator and TensorFlow's workers (``port + 1 + local rank``) of
    up to 15 tasks per node.

    Raises:
        ClusterError: a port that is no number in 1..65535, or no job id to derive one from.
    """
    if env.get(PORT_ENV, "").strip():
        text = env[PORT_ENV].strip()
        if not text.isdigit() or not 0 < int(text) < 65536:
            raise ClusterError(
                "Expected {} to be a port in 1..65535. Received: {}={!r}".format(PORT_ENV, PORT_ENV, text))
        return int(text)
    numbers = []
    for names in (("SLURM_JOB_ID", "SLURM_JOBID"), ("SLURM_RESTART_COUNT",), _STEP_VARIABLES):
        name = next((n for n in names if env.get(n, "").strip()), None)
        value = env[name].strip() if name else "0"
        if name is None and names[0] == "SLURM_JOB_ID":
            raise ClusterError("Expected SLURM_JOB_ID (or {}) to derive the coordinator's port from. "
                               "Received neither.".format(PORT_ENV))
        if not value.isdigit():
            raise ClusterError("Expected an integer in {}. Received: {}={!r}".format(name, name, value))
        numbers.append(int(value))
    job, restart, step = numbers
    return FIRST_PORT + SLOT_SIZE * ((97 * job + 13 * restart + step) % SLOTS)


def _read(env: Mapping[str, str],
          names: Tuple[str, ...],
          variables: Dict[str, str],
          required: bool = True) -> Optional[str]:
    for name in names:
        if env.get(name, "").strip():
            variables[name] = env[name]
            return env[name].strip()
    if required:
        raise ClusterError("Expected {} in this Slurm task's environment. Received: {}".format(
            " or ".join(names), _listing(variables)))
    return None


def _number(env: Mapping[str, str],
            names: Tuple[str, ...],
            variables: Dict[str, str],
            required: bool = True) -> Optional[int]:
    value = _read(env, names, variables, required)
    if value is None:
        return None
    if not value.isdigit():
        name = next(n for n in names if n in variables)
        raise ClusterError("Expected an integer in {} (set by Slurm). Received: {}={!r}".format(name, name, value))
    return int(value)


def _listing(variables: Mapping[str, str]) -> str:
    return ", ".join("{}={}".format(k, v) for k, v in sorted(variables.items())) or "none"


def job_tasks(env: Mapping[str, str]) -> int:
    """How many tasks the job (not a step) asks for: ``SLURM_NTASKS``, else the sum of ``SLURM_TASKS_PER_NODE``
    (an allocation without ``--ntasks``), else ``SLURM_JOB_NUM_NODES``; 1 where none is set."""
    for name in ("SLURM_NTASKS", "SLURM_NPROCS"):
        if env.get(name, "").strip().isdigit():
            return int(env[name])
    if env.get("SLURM_TASKS_PER_NODE", "").strip():
        try:
            return sum(expand_tasks_per_node(env["SLURM_TASKS_PER_NODE"]))
        except ClusterError:
            pass
    text = env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "")).strip()
    return int(text) if text.isdigit() else 1


def in_step(env: Mapping[str, str]) -> bool:
    """Whether this process is a task of a job step (``srun``), not the batch script or an allocation's shell."""
    return any(env.get(name, "").strip() for name in _STEP_VARIABLES)


class Slurm(Environment):
    """The tasks of an ``srun`` step; see the module docstring."""

    name = "slurm"
    launcher = False
    requires = "SLURM_JOB_ID"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return bool(env.get("SLURM_JOB_ID", env.get("SLURM_JOBID", "")).strip())

    def read(self, env: Mapping[str, str]) -> Cluster:
        variables: Dict[str, str] = {}
        _read(env, ("SLURM_JOB_ID", "SLURM_JOBID"), variables)
        if not in_step(env):
            return self._outside_step(env, variables)
        _read(env, _STEP_VARIABLES, variables)  # recorded in variables
        world = _number(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"), variables)
        rank = _number(env, ("SLURM_PROCID",), variables)
        if world is None or rank is None:  # for the type checker: required values are never None
            raise ClusterError("unreachable")
        if world == 1:
            return Cluster(0, 1, 0, 1, None, self.name, None, variables)
        local_rank = _number(env, ("SLURM_LOCALID",), variables)
        node_id = _number(env, ("SLURM_NODEID",), variables)
        nodes = expand_hostlist(_read(env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"), variables)
                                or "")
        per_node = expand_tasks_per_node(_read(env, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"), variables)
                                         or "")
        distribution = _read(env, ("SLURM_DISTRIBUTION",), variables, required=False) or "block"
        count = _number(env, ("SLURM_STEP_NUM_NODES",), variables, required=False)
        problem = None
        if len(nodes) != len(per_node) or (count is not None and count != len(nodes)):
            problem = "{} nodes, {} counts of tasks per node".format(len(nodes), len(per_node))
        elif sum(per_node) != world:
            problem = "{} tasks per node add up to {}, not the step's {} tasks".format(per_node, sum(per_node), world)
        elif not 0 <= rank < world:
            problem = "rank {} is outside 0..{}".format(rank, world - 1)
        if problem is None:
            ranks = placement(per_node, distribution)
            if ranks[rank] != (node_id, local_rank):
                problem = ("with the {} distribution rank {} runs on node {} as local rank {}, but this task is local "
                           "rank {} on node {}".format(distribution, rank, ranks[rank][0], ranks[rank][1], local_rank,
                                                       node_id))
        if problem is not None:
            raise ClusterError(
                "This Slurm step's variables disagree with each other ({}), so distkeras can't tell where each rank "
                "runs. Received: {}".format(problem, _listing(variables)))
        port = coordinator_port(env)
        if PORT_ENV in env:
            variables[PORT_ENV] = env[PORT_ENV]
        if max(per_node) >= SLOT_SIZE and PORT_ENV not in variables:
            raise ClusterError(
                "Expected at most {} tasks per node for the derived coordinator port range (each task's TensorFlow "
                "worker takes port + 1 + local rank). Received: SLURM_STEP_TASKS_PER_NODE={}. Set {} to a port "
                "with {} free ports above it.".format(SLOT_SIZE - 1, variables.get("SLURM_STEP_TASKS_PER_NODE"),
                                                        PORT_ENV, max(per_node)))
        workers = tuple("{}:{}".format(nodes[n], port + 1 + local) for n, local in ranks)
        return Cluster(rank, world, local_rank, per_node[node_id], "{}:{}".format(nodes[0], port), self.name,
                       workers, variables)

    def _outside_step(self, env: Mapping[str, str], variables: Dict[str, str]) -> Cluster:
        """The batch script or an allocation's shell: one process of a job that may have many tasks."""
        for name in ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_TASKS_PER_NODE", "SLURM_JOB_NUM_NODES", "SLURM_PROCID"):
            if env.get(name, "").strip():
                variables[name] = env[name]
        tasks = job_tasks(env)
        if tasks > 1:
            raise ClusterError(
                "This process runs inside Slurm job {} but is no task of a job step (no SLURM_STEP_ID: the batch "
                "script itself, or an salloc shell), and the job has {} tasks. Only srun starts them: run it with "
                "srun (`srun python train.py` in the batch script) and every task joins the job. To train alone on "
                "purpose, set DISTKERAS_ENVIRONMENT=single. Received: {}".format(
                    variables.get("SLURM_JOB_ID", variables.get("SLURM_JOBID")), tasks, _listing(variables)))
        return Cluster(0, 1, 0, 1, None, self.name, None, variables)


def launch_arguments(env: Mapping[str, str]) -> Dict[str, object]:
    """``distkeras launch``'s ``nnodes``, ``node_rank`` and ``coordinator`` inside ``srun --ntasks-per-node=1``.

    Returns:
        ``{}`` outside a Slurm step; else ``{"nnodes": tasks, "node_rank": SLURM_PROCID, "coordinator":
        "<first node>:<coordinator_port>"}``, the launchers being the step's tasks.

    Raises:
        ClusterError: a step with more than one task on a node (one launcher per node starts that node's
            workers), or variables that disagree.
    """
    if not Slurm.detect(env) or not in_step(env):
        return {}
    cluster = Slurm().read(env)
    if cluster.local_world_size != 1:
        raise ClusterError(
            "Expected one `distkeras launch` per node (srun --ntasks-per-node=1 distkeras launch --nproc-per-node N "
            "...): each launcher starts its node's workers. Received: {} tasks on this node "
            "(SLURM_STEP_TASKS_PER_NODE={}).".format(cluster.local_world_size,
                                                     (cluster.variables or {}).get("SLURM_STEP_TASKS_PER_NODE")))
    return {"nnodes": cluster.world_size, "node_rank": cluster.rank, "coordinator": cluster.coordinator}
