"""Run the test suites, each in its own process (Keras fixes its backend at import), and add them up.

Suites: the pure core (no framework needed), then tests/backends once per live Keras backend with
KERAS_BACKEND set, then tests/mxnet with the Python of the keras-mxnet environment (.venv-mxnet, made by
scripts/mxnet-env.sh): keras-mxnet installs its own `keras`, so it can't share an environment with Keras 3.
Then tests/cntk: its worker processes run on the real CNTK runtime, the CPython 3.6 of .venv-cntk (made by
scripts/cntk-env.sh, with CNTK 2.7 and Keras 2.3.1) under Open MPI's mpiexec; DISTKERAS_CNTK_PYTHON names
another such Python. Where there is none, those tests skip and say why. Then tests/clusters: jobs that cluster
environments start (torchrun...) on several backends; its pytest process imports no framework.
Prints one closing line, "tests: N passed, N failed, N skipped", and exits non-zero if any suite failed
or errored. Extra arguments go to every pytest run (e.g. -k, -x). DISTKERAS_SUITES=a,b runs only the named
suites; DISTKERAS_TESTS=path,path (test files or folders) runs only those, each in the suites whose paths hold
it, and skips the suites that hold none.
"""

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MXNET_VENV = os.path.join(ROOT, ".venv-mxnet")
CNTK_PYTHON = os.environ.get("DISTKERAS_CNTK_PYTHON") or os.path.join(ROOT, ".venv-cntk", "bin", "python")


def backend_suite(name):
    """tests/backends without the files of the other live backends (test_<backend>*.py: they would only skip here)."""
    import glob

    others = [b for b in ("tensorflow", "jax", "torch") if b != name]
    files = sorted(f for b in others for f in glob.glob(os.path.join(ROOT, "tests", "backends", "test_{}*.py".format(b))))
    return ["tests/backends"] + ["--ignore=" + os.path.relpath(f, ROOT) for f in files]


#: (name, environment, test paths, Python interpreter; None = the one running this script).
SUITES = [
    ("core", {}, ["tests/core"], None),
    ("tensorflow", {"KERAS_BACKEND": "tensorflow"}, backend_suite("tensorflow"), None),
    ("jax", {"KERAS_BACKEND": "jax"}, backend_suite("jax"), None),
    ("torch", {"KERAS_BACKEND": "torch"}, backend_suite("torch"), None),
    (
        "mxnet",
        {"KERAS_BACKEND": "mxnet", "KERAS_HOME": os.path.join(MXNET_VENV, "keras-home")},
        ["tests/mxnet"],
        os.path.join(MXNET_VENV, "bin", "python"),
    ),
    ("cntk", {"DISTKERAS_CNTK_PYTHON": CNTK_PYTHON}, ["tests/cntk"], None),
    # Real clusters (Slurm, Ray, torchrun) for every Keras 3 backend: the pytest process imports no framework, each job
    # sets KERAS_BACKEND itself.
    ("clusters", {}, ["tests/clusters"], None),
]


def restrict(paths, wanted):
    """The suite's pytest arguments for only the ``wanted`` paths that lie in its test paths; None if none do."""
    options = [p for p in paths if p.startswith("-")]
    roots = [p.rstrip("/") for p in paths if not p.startswith("-")]
    picked = [w for w in wanted if any(w.rstrip("/") == r or w.startswith(r + "/") for r in roots)
              and "--ignore=" + w not in options]
    return picked + options if picked else None


def count(junit_path):
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    if not os.path.exists(junit_path):
        return totals
    for suite in ET.parse(junit_path).getroot().iter("testsuite"):
        tests = int(suite.get("tests", 0))
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped = int(suite.get("skipped", 0))
        totals["failed"] += failed
        totals["skipped"] += skipped
        totals["passed"] += tests - failed - skipped
    return totals


def main(argv):
    only = os.environ.get("DISTKERAS_SUITES", "").split(",") if os.environ.get("DISTKERAS_SUITES") else None
    wanted = os.environ.get("DISTKERAS_TESTS", "").split(",") if os.environ.get("DISTKERAS_TESTS") else None
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    failed_suites = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, env, paths, python in SUITES:
            if only and name not in only:
                continue
            if wanted:
                paths = restrict(paths, wanted)
                if paths is None:
                    continue
            junit = os.path.join(tmp, name + ".xml")
            print("\n==== suite: {} ====".format(name), flush=True)
            if python is not None and not os.path.exists(python):
                print("==== suite {}: no interpreter at {}; run scripts/mxnet-env.sh (scripts/test.sh does)".format(
                    name, os.path.relpath(python, ROOT)), flush=True)
                failed_suites.append(name)
                continue
            started = time.time()
            code = subprocess.call(
                [python or sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--junitxml", junit, *paths, *argv],
                cwd=ROOT,
                env={**os.environ, **env},
            )
            got = count(junit)
            print("==== suite {}: {passed} passed, {failed} failed, {skipped} skipped in {:.0f}s (exit {})".format(
                name, time.time() - started, code, **got), flush=True)
            for key in totals:
                totals[key] += got[key]
            if code not in (0, 5) or got["failed"]:
                failed_suites.append(name)
    if failed_suites:
        print("failed suites: " + ", ".join(failed_suites))
    print("tests: {passed} passed, {failed} failed, {skipped} skipped".format(**totals))
    return 1 if failed_suites or totals["passed"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
