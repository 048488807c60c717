"""A real Slurm cluster for tests: munged, slurmctld and one slurmd per network-namespace host.

    with SlurmCluster(nodes=2) as cluster:        # nodes n0 (10.47.0.1) and n1 (10.47.0.2)
        done = cluster.run(["srun", "-N2", "-n2", "hostname"], timeout=60)

Debian's ``slurm-wlm`` and ``munge`` (Slurm 22.05), installed with apt-get when they are missing and this runs
as root (:func:`ensure_installed`; :func:`unavailable` says why not, for a skip reason). Nothing of the
machine's own Slurm or munge set-up is used or touched: one munge key, socket and log, one ``slurm.conf``, the
controller's state and every node's spool directory live in a temporary folder. Every daemon runs in the
foreground as a child of this process (no systemd): ``munged`` (its Unix socket reaches every namespace
through the shared file system), ``slurmctld`` and node ``n0``'s ``slurmd`` on host 0, node ``n1``'s
``slurmd`` on host 1 (:class:`tests.netns.Hosts`). Commands (``srun``, ``sbatch``, ``sinfo``...) run on host 0
with ``SLURM_CONF`` pointing at the private configuration, as root.

Everything runs in its host's network namespace and a mount namespace of its own, where a private hosts file
(the machine's, plus ``10.47.0.<i+1> n<i>``) is bind-mounted over /etc/hosts, so node names resolve as on a
cluster. Not ``ip netns exec``: it also mounts a fresh /sys, without the cgroup file systems that slurmd
insists on finding (even with ``proctrack/linuxproc``); ``nsenter --net`` plus ``unshare --mount`` keeps them.

Slurm as a single machine without cgroups runs it: ``proctrack/linuxproc``, ``task/none``, no accounting,
``select/cons_tres`` with CPUs as the consumable. Each node declares :data:`CPUS_PER_NODE` CPUs whatever the
machine has (``SlurmdParameters=config_overrides``): the tests place 2 tasks per node on a 2-core machine.
DISTKERAS_KEEP_SLURM=1 keeps the temporary folder (logs, state) after the cluster stops, for debugging.
"""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from tests import netns

# Run "$@" with the hosts file $1 over /etc/hosts, in a mount namespace of its own (see the module docstring).
_WITH_HOSTS = 'mount --bind "$0" /etc/hosts && exec "$@"'

#: CPUs each node declares (over-declared on purpose: the tests need 2 tasks per node, not 2 real cores each).
CPUS_PER_NODE = 4
PACKAGES = ["slurm-wlm", "munge"]
BINARIES = ["nsenter", "unshare", "munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "scontrol", "scancel"]

CONFIG = """\
ClusterName=dktest
SlurmctldHost={controller}({controller_address})
MailProg=/bin/true
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
LaunchParameters=use_interactive_step
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
MinJobAge=300
KillWait=5
UnkillableStepTimeout=30
MessageTimeout=20
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
SchedulerType=sched/backfill
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


def missing():
    """The Slurm and munge programs that aren't on PATH."""
    return [b for b in BINARIES if shutil.which(b) is None]


def ensure_installed(timeout=600):
    """Install slurm-wlm and munge with apt-get when missing; return why they are still missing, or None."""
    if not missing():
        return None
    if os.geteuid() != 0:
        return "Slurm is not installed ({} missing) and installing it needs root".format(", ".join(missing()))
    if shutil.which("apt-get") is None:
        return "Slurm is not installed ({} missing) and there is no apt-get to install it".format(", ".join(missing()))
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends"] + PACKAGES
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
        if done.returncode != 0:  # a stale package list: update once, then try again
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=timeout)
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "`{}` took more than {} s".format(" ".join(command), timeout)
    if done.returncode != 0 or missing():
        return "`{}` failed (exit code {}): {}".format(" ".join(command), done.returncode, done.stderr.strip()[-500:])
    return None


def unavailable():
    """Why a Slurm cluster can't be made here (after trying to install it), or None when it can."""
    return netns.unavailable() or ensure_installed()


def _stop(process, grace=10.0):
    """SIGTERM ``process``, SIGKILL it after ``grace`` seconds; by PID, never by name."""
    if process is None or process.poll() is not None:
        return
    try:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=grace)
    except ProcessLookupError:
        pass


class SlurmCluster(object):
    """A running Slurm cluster of ``nodes`` nodes, ``n0`` .. (see the module docstring).

    Attributes:
        root: the temporary folder with its configuration, state, spool directories and logs.
        hosts: the :class:`tests.netns.Hosts` the nodes run on (node ``n<i>`` on host ``i``).
        nodes: the node names.
        conf: the path of ``slurm.conf``.
    """

    def __init__(self, nodes=2, start_timeout=60):
        self.root = tempfile.mkdtemp(prefix="dkslurm")
        self.nodes = ["n{}".format(i) for i in range(nodes)]
        self.hosts = None
        self.munged = None
        self.daemons = []  # slurmctld and the slurmds, in the namespaces
        self.conf = os.path.join(self.root, "slurm.conf")
        try:
            self._start(start_timeout)
        except BaseException:
            self.close()
            raise

    # -- start -------------------------------------------------------------------------------------------
    def _start(self, start_timeout):
        os.chmod(self.root, 0o755)  # munged wants directories only root can write to
        for sub in ["state", "spool", "munge"] + ["spool/" + n for n in self.nodes]:
            os.makedirs(os.path.join(self.root, sub), mode=0o755, exist_ok=True)
        munge = os.path.join(self.root, "munge")
        self.munge_socket = os.path.join(munge, "munge.socket")
        key = os.path.join(munge, "munge.key")
        with open(key, "wb") as sink:
            sink.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.hosts = netns.Hosts(len(self.nodes))
        self.hosts_file = os.path.join(self.root, "hosts")
        names = "".join("{} {}\n".format(a, n) for a, n in zip(self.hosts.addresses, self.nodes))
        with open("/etc/hosts") as source:
            machine = source.read()
        with open(self.hosts_file, "w") as sink:
            sink.write(machine.rstrip("\n") + "\n" + names)
        # munged on host 0 too (its Unix socket serves every namespace): a test run killed before it could
        # clean up leaves no daemon behind, as the next Hosts deletes its namespaces with what runs in them.
        self.munged = self._daemon(0, "munged", [
            "munged", "--foreground", "--force", "--socket", self.munge_socket, "--key-file", key, "--pid-file",
            os.path.join(munge, "munged.pid"), "--log-file", os.path.join(munge, "munged.log"), "--seed-file",
            os.path.join(munge, "munged.seed")])
        self._wait(lambda: os.path.exists(self.munge_socket), 20, "munged's socket", self.munged)

        node_lines = "\n".join(
            "NodeName={} NodeAddr={} CPUs={} RealMemory=1000 State=UNKNOWN".format(n, a, CPUS_PER_NODE)
            for n, a in zip(self.nodes, self.hosts.addresses))
        with open(self.conf, "w") as sink:
            # slurmctld only runs where gethostname() is a SlurmctldHost (the UTS namespace is the machine's)
            sink.write(CONFIG.format(controller=socket.gethostname().split(".")[0],
                                     controller_address=self.hosts.addresses[0], munge_socket=self.munge_socket,
                                     root=self.root, nodes=node_lines))
        self.daemons.append(self._daemon(0, "slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf]))
        for i, node in enumerate(self.nodes):
            self.daemons.append(self._daemon(i, "slurmd." + node, ["slurmd", "-D", "-N", node, "-f", self.conf]))
        self._wait(self._all_idle, start_timeout, "every node idle in sinfo", *self.daemons)

    def _daemon(self, host, name, command):
        """Start a daemon in the foreground on host ``host``; its stderr goes to ``<root>/<name>.stderr`` (a pipe
        nobody reads would fill up and block it)."""
        with open(os.path.join(self.root, name + ".stderr"), "w") as sink:
            process = subprocess.Popen(self.command(host, command), env=self.env(), stdout=subprocess.DEVNULL,
                                       stderr=sink)
        process.name = name
        return process

    def _all_idle(self):
        done = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=20, check=False)
        states = dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)
        return all(states.get(n) == "idle" for n in self.nodes)

    def _wait(self, ready, timeout, what, *processes):
        deadline = time.time() + timeout
        while time.time() < deadline:
            for process in processes:
                if process.poll() is not None:
                    with open(os.path.join(self.root, process.name + ".stderr"), errors="replace") as source:
                        stderr = source.read()[-2000:]
                    raise RuntimeError("{} exited ({}) before {}: {}\n{}".format(
                        process.name, process.returncode, what, stderr, self.logs()))
            if ready():
                return
            time.sleep(0.3)
        raise RuntimeError("no {} after {} s\n{}".format(what, timeout, self.logs()))

    # -- use ---------------------------------------------------------------------------------------------
    def env(self, **extra):
        """The environment for a Slurm command of this cluster: this process' own, SLURM_CONF pointing at
        the private configuration, and ``extra``; no variable of an enclosing Slurm job."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        env["SLURM_CONF"] = self.conf
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def command(self, host, args):
        """``args`` as a command line that runs on host ``host``, with the cluster's hosts file."""
        return ["nsenter", "--net=/run/netns/" + self.hosts.names[host], "unshare", "--mount", "--propagation",
                "private", "sh", "-c", _WITH_HOSTS, self.hosts_file] + list(args)

    def run(self, args, timeout, env=None, host=0, check=True, cwd=None):
        """Run a command (``srun ...``) on host ``host`` to completion; ``env`` as :meth:`env` returns it."""
        done = subprocess.run(self.command(host, args), env=env or self.env(), capture_output=True, text=True,
                              timeout=timeout, cwd=cwd)
        if check and done.returncode != 0:
            raise RuntimeError("{} failed ({}):\n{}\n{}".format(" ".join(args), done.returncode, done.stdout[-3000:],
                                                               done.stderr[-3000:]))
        return done

    def popen(self, args, env=None, host=0, **kwargs):
        """Start a command on host ``host`` (a :class:`subprocess.Popen`, in its own process group)."""
        return subprocess.Popen(self.command(host, args), env=env or self.env(), start_new_session=True, **kwargs)

    def logs(self, tail=3000):
        """The tails of the daemons' logs, for failure messages."""
        parts = []
        for name in ["slurmctld.log"] + ["slurmd.{}.log".format(n) for n in self.nodes] + ["munge/munged.log"]:
            path = os.path.join(self.root, name)
            if os.path.exists(path):
                with open(path, errors="replace") as source:
                    parts.append("--- {}\n{}".format(name, source.read()[-tail:]))
        return "\n".join(parts)

    def cancel_all(self):
        """scancel every job of the cluster (a test that failed half-way leaves none behind)."""
        if self.hosts is not None and self.daemons and self.daemons[0].poll() is None:
            try:
                self.run(["scancel", "--full", "--quiet", "--user", "root"], timeout=20, check=False)
            except subprocess.TimeoutExpired:
                pass

    # -- stop --------------------------------------------------------------------------------------------
    def close(self):
        """scancel what is left, stop every daemon by PID, delete the namespaces and every file. Safe twice."""
        try:
            self.cancel_all()
        finally:
            for process in reversed(self.daemons):  # the slurmds first, then slurmctld
                _stop(process)
            self.daemons = []
            _stop(self.munged)
            self.munged = None
            if self.hosts is not None:
                self.hosts.close()  # kills whatever still runs in the namespaces (slurmstepd, tasks)
                self.hosts = None
            if self.root and os.environ.get("DISTKERAS_KEEP_SLURM") != "1":
                shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def cluster_fixture():
    """A pytest session fixture body: one cluster for every test, or a skip saying why there can be none."""
    import pytest

    reason = unavailable()
    if reason:
        print("skipping the Slurm tests: " + reason)
        pytest.skip(reason)
    with SlurmCluster() as cluster:
        yield cluster
