"""Every import path users, the docs, the examples and README.md rely on keeps working, whatever the package's
layout: each public path names the same object as its home (the module that defines it). When code moves, its
home changes here and its public path stays. Nothing here imports a framework."""

import importlib
import importlib.util
import subprocess
import sys

import pytest

#: ``public dotted path: home "module:attribute"`` (a module's own path: its home module, attribute "").
PUBLIC = {
    # the package root: the API, the records, the errors
    "distkeras.distribute": "distkeras.api:distribute",
    "distkeras.describe": "distkeras.api:describe",
    "distkeras.global_batch_size": "distkeras.api:global_batch_size",
    "distkeras.use_cpu_devices": "distkeras.api:use_cpu_devices",
    "distkeras.shutdown": "distkeras.api:shutdown",
    "distkeras.attach": "distkeras.loops:attach",
    "distkeras.distribute_dataset": "distkeras.loops:distribute_dataset",
    "distkeras.distribute_step": "distkeras.loops:distribute_step",
    "distkeras.is_main_process": "distkeras.ranks:is_main_process",
    "distkeras.rank": "distkeras.ranks:rank",
    "distkeras.size": "distkeras.ranks:size",
    "distkeras.local_rank": "distkeras.ranks:local_rank",
    "distkeras.local_size": "distkeras.ranks:local_size",
    "distkeras.print0": "distkeras.ranks:print0",
    "distkeras.shard": "distkeras.sharding:shard",
    "distkeras.shard_bounds": "distkeras.sharding:shard_bounds",
    "distkeras.Device": "distkeras.devices:Device",
    "distkeras.Cluster": "distkeras.cluster.record:Cluster",
    "distkeras.cluster.Cluster": "distkeras.cluster.record:Cluster",
    "distkeras.cluster.SINGLE": "distkeras.cluster.record:SINGLE",
    "distkeras.DistKerasError": "distkeras.errors:DistKerasError",
    "distkeras.VerifyError": "distkeras.errors:VerifyError",
    "distkeras.TooLateError": "distkeras.errors:TooLateError",
    "distkeras.DataError": "distkeras.errors:DataError",
    "distkeras.CheckpointError": "distkeras.errors:CheckpointError",
    # modules named in the docs (mkdocstrings' ::: references among them)
    "distkeras.errors": "distkeras.errors:",
    "distkeras.errors.OptionError": "distkeras.errors:OptionError",
    "distkeras.errors.DeviceSpecError": "distkeras.errors:DeviceSpecError",
    "distkeras.errors.CollectiveError": "distkeras.errors:CollectiveError",
    "distkeras.callbacks": "distkeras.callbacks:",
    "distkeras.callbacks.BackupAndRestore": "distkeras.callbacks:BackupAndRestore",
    "distkeras.environments": "distkeras.environments:",
    "distkeras.environments.find": "distkeras.environments:find",
    "distkeras.environments.Found": "distkeras.environments:Found",
    "distkeras.environments.ray": "distkeras.environments.ray:",
    "distkeras.environments.ray.prepare_jax": "distkeras.environments.ray:prepare_jax",
    "distkeras.cluster.from_env": "distkeras.cluster:from_env",
    "distkeras.layouts": "distkeras.parallel.layouts:",
    "distkeras.parallel.layouts": "distkeras.parallel.layouts:",
    "distkeras.launch": "distkeras.launch:",
    "distkeras.launch.EXIT_PREEMPTED": "distkeras.launch.processes:EXIT_PREEMPTED",
    "distkeras.launch.free_port": "distkeras.launch.network:free_port",
    "distkeras.verify.Check": "distkeras.verify.check:Check",
    "distkeras.verify.tolerance_for": "distkeras.verify.check:tolerance_for",
    "distkeras.sharding.batch_rows": "distkeras.sharding:batch_rows",
    "distkeras.backends.REGISTRY": "distkeras.backends:REGISTRY",
    "distkeras.backends.batchnorm": "distkeras.backends.batchnorm:",
    "distkeras.verify": "distkeras.verify:",
}

#: Modules run with ``python -m`` (by users, the launcher's own command lines and the tests).
RUNNABLE = ["distkeras"]


def resolve(dotted):
    """The object at a dotted path: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ImportError(dotted)


@pytest.mark.parametrize("public", sorted(PUBLIC))
def test_public_path_is_its_home(public):
    module, _, attribute = PUBLIC[public].partition(":")
    home = importlib.import_module(module)
    if attribute:
        home = getattr(home, attribute)
    assert resolve(public) is home


def test_the_root_exports_what_its_all_says():
    import distkeras

    for name in distkeras.__all__:
        assert getattr(distkeras, name) is not None, name


@pytest.mark.parametrize("module", RUNNABLE)
def test_runnable_with_python_m(module):
    assert importlib.util.find_spec(module + ".__main__" if module == "distkeras" else module) is not None
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_every_dotted_path_the_docs_name_is_listed_here():
    """A ```distkeras.x.y``` the docs, README.md or an example names is a path users copy: it must be in PUBLIC, so
    the test above keeps it working when code moves."""
    import glob
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    files = (glob.glob(os.path.join(root, "docs", "**", "*.md"), recursive=True) + [os.path.join(root, "README.md")]
             + glob.glob(os.path.join(root, "examples", "*.py")))
    named = set()
    for path in files:
        named.update(re.findall(r"`(distkeras(?:\.[A-Za-z_]\w*)+)", open(path).read()))
    assert named, "no dotted path found: the pattern is wrong"
    assert not named - set(PUBLIC), "named in the docs, not in PUBLIC: {}".format(sorted(named - set(PUBLIC)))
