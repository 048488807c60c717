"""The modules a CNTK user imports must run on CPython 3.6 (CNTK 2.7's last Python)."""

import glob
import os
import subprocess
import sys

import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src", "distkeras")
CORE = ["__init__.py", "__main__.py", "api.py", "devices.py", "cluster/__init__.py", "cluster/record.py", "worker.py", "sharding.py", "errors.py",
        "launch/__init__.py", "launch/command.py", "launch/processes.py", "cli.py", "launch/network.py",
        "launch/rendezvous.py",  # `distkeras launch` starts CNTK jobs
        "info.py",  # `distkeras info`'s versions (importlib.metadata where it exists)
        "verify/__init__.py", "verify/check.py", "verify/datacheck.py",  # the checks' switches, which api reads
        "parallel/__init__.py", "parallel/layouts.py",  # distkeras.layouts, imported with the package
        "launch/relay.py", "ranks.py",  # the launcher's output relay; is_main_process() and print0()
        "launch/exchange.py",  # what TF and JAX workers under torchrun exchange (imports torch only when it does)
        "backends/__init__.py", "backends/base.py", "backends/keras_model.py", "backends/policies.py",
        "backends/batchnorm.py",  # the BatchNormalization rule, framework-free
        "backends/agreement.py",  # policies' saves wait on it, framework-free
        # the two Keras 2 backends, whole (keras-mxnet 2.2.4.3 itself is at home on Python 3.6-3.8)
        "backends/cntk/__init__.py", "backends/cntk/adapter.py", "backends/cntk/launch.py",
        "backends/mxnet/__init__.py", "backends/mxnet/adapter.py", "backends/mxnet/job.py", "backends/mxnet/launch.py",
        "backends/mxnet/loops.py", "backends/mxnet/shims.py", "backends/mxnet/steps.py"]
OPTIONAL = []  # checked as soon as they exist
#: Outside the package, what CNTK users run: the scenario-1 example.
SCRIPTS = [os.path.join(os.path.dirname(os.path.dirname(SRC)), "examples", "mnist_mlp_cntk.py")]


def files():
    found = [os.path.join(SRC, f) for f in CORE] + SCRIPTS
    found += [os.path.join(SRC, f) for f in OPTIONAL if os.path.exists(os.path.join(SRC, f))]
    found += sorted(glob.glob(os.path.join(SRC, "environments", "*.py")))  # every cluster environment, as it is added
    return found


def test_core_files_need_at_most_python_3_6():
    vermin = pytest.importorskip("vermin", reason="vermin checks the Python 3.6 syntax (pip install vermin)")
    del vermin
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from vermin.main import main; sys.exit(main())", "-t=3.6-", "--no-tips", "--violations", "--eval-annotations",
         "--backport", "typing", *files()],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, "vermin found code newer than Python 3.6:\n" + done.stdout + done.stderr


def test_the_check_catches_newer_code(tmp_path):
    pytest.importorskip("vermin")
    newer = tmp_path / "newer.py"
    newer.write_text("import dataclasses\nif (n := 3):\n    print(f'{n=}')\n")
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from vermin.main import main; sys.exit(main())",
         "-t=3.6-", "--no-tips", "--violations", str(newer)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode != 0
