"""A real two-node Ray cluster made of two network-namespace hosts (tests/netns.py), for test_ray.py.

    with RayCluster() as cluster:                 # head on 10.47.0.1:6379, a worker node on 10.47.0.2
        done = cluster.driver(["-m", "tests.clusters.ray_job", ...], timeout=300)

Each node is ``ray start --block`` in its own namespace: ``cpus`` CPUs (one per job that runs at once), a
small object store, no dashboard, a temporary directory of its own; drivers run in the head's namespace.
:meth:`RayCluster.close` (also on an exception) stops each ``ray start`` by its process group, then the
namespaces go with every process left in them (drivers, raylets, workers). ``ray stop`` is never used: it
finds Ray's processes by name, machine-wide.
"""

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from tests import netns

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PORT = 6379
START_TIMEOUT = 90


def unavailable():
    """Why a Ray cluster can't be made here, or None when it can."""
    try:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            return "ray is not installed (pip install 'ray[train]')"
    except ImportError:
        return "ray is not installed"
    return netns.unavailable()


def _ray_command():
    return [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())"]


class RayCluster(object):
    """Two Ray nodes, one per namespace host. Attributes: ``address`` (the head's ``host:port``), ``hosts``."""

    #: The nodes' addresses (netns.Hosts' first two).
    ADDRESSES = ("{}.1".format(netns.SUBNET), "{}.2".format(netns.SUBNET))

    def __init__(self, cpus=1, env=None):
        self.hosts = netns.Hosts(2)
        self.address = "{}:{}".format(self.hosts.addresses[0], PORT)
        self._nodes = []
        self._dirs = []
        self.cpus = cpus
        self.env = dict(os.environ if env is None else env)
        self.env.update(PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT]), RAY_USAGE_STATS_ENABLED="0",
                        JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2",
                        # Ray 2.5x's token authentication, with a token of this cluster's own (not ~/.ray's).
                        RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        for name in ("KERAS_BACKEND", "RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", "XLA_FLAGS"):
            self.env.pop(name, None)
        self.env = {k: v for k, v in self.env.items() if not k.startswith("DISTKERAS_")}
        try:
            for host in (0, 1):
                self._start(host)
            self._wait_for_nodes(2)
        except BaseException:
            self.close()
            raise

    def _start(self, host):
        temp = tempfile.mkdtemp(prefix="dkray")  # short: Ray's socket paths live under it
        self._dirs.append(temp)
        address = self.hosts.addresses[host]
        args = _ray_command() + ["start", "--block", "--node-ip-address", address, "--num-cpus", str(self.cpus),
                                 "--object-store-memory", str(80 * 1024 * 1024), "--temp-dir", temp,
                                 "--disable-usage-stats"]
        if host == 0:
            args += ["--head", "--port", str(PORT), "--include-dashboard=false"]
        else:
            args += ["--address", self.address]
        log = open(os.path.join(temp, "start.log"), "w")
        self._nodes.append(self.hosts.popen(host, args, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True))
        log.close()

    def _wait_for_nodes(self, count):
        probe = ("import ray, time\nray.init(address={!r}, log_to_driver=False)\n"
                 "while len([n for n in ray.nodes() if n['Alive']]) < {}: time.sleep(0.5)\n"
                 ).format(self.address, count)
        deadline = time.time() + START_TIMEOUT
        while True:
            for node in self._nodes:
                if node.poll() is not None:
                    raise RuntimeError("ray start exited ({}):\n{}".format(node.returncode, self.logs()))
            try:
                done = self.driver(["-c", probe], timeout=max(1, deadline - time.time()), capture_output=True,
                                   text=True)
            except subprocess.TimeoutExpired:
                raise RuntimeError("the Ray cluster did not come up in {} s:\n{}".format(START_TIMEOUT, self.logs()))
            if done.returncode == 0:
                return
            if time.time() > deadline:
                raise RuntimeError("the Ray cluster did not come up in {} s: {}\n{}".format(
                    START_TIMEOUT, done.stderr[-2000:], self.logs()))
            time.sleep(1)

    def logs(self):
        text = []
        for temp in self._dirs:
            try:
                with open(os.path.join(temp, "start.log")) as f:
                    text.append(f.read()[-2000:])
            except OSError:
                pass
        return "\n----\n".join(text)

    def driver(self, args, timeout, env=None, **kwargs):
        """Run ``python ARGS`` in the head's namespace (a Ray driver there reaches the cluster at ``address``)."""
        full = dict(self.env)
        full.update(env or {})
        return self.hosts.run(0, [sys.executable] + list(args), env=full, cwd=ROOT, timeout=timeout, **kwargs)

    def start_driver(self, args, env=None, **kwargs):
        """Start ``python ARGS`` in the head's namespace (a :class:`subprocess.Popen`); :meth:`close` ends it."""
        full = dict(self.env)
        full.update(env or {})
        return self.hosts.popen(0, [sys.executable] + list(args), env=full, cwd=ROOT, **kwargs)

    def close(self):
        """Stop every node by its process group, then delete the namespaces (and what still runs there)."""
        for node in self._nodes:
            if node.poll() is None:
                try:
                    os.killpg(node.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for node in self._nodes:
            try:
                node.wait(timeout=5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(node.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                node.wait(timeout=5)
        self._nodes = []
        self.hosts.close()
        for temp in self._dirs:
            shutil.rmtree(temp, ignore_errors=True)
        self._dirs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
