"""Run the test suites, each in its own process (Keras fixes its backend at import), and add them up.

Suites: the pure core (no framework needed), then tests/backends once per live Keras backend with
KERAS_BACKEND set, then tests/mxnet with the Python of the keras-mxnet environment (.venv-mxnet, made by
scripts/mxnet-env.sh): keras-mxnet installs its own `keras`, so it can't share an environment with Keras 3.
Then tests/cntk: its worker processes run on the real CNTK runtime, the CPython 3.6 of .venv-cntk (made by
scripts/cntk-env.sh, with CNTK 2.7 and Keras 2.3.1) under Open MPI's mpiexec; DISTKERAS_CNTK_PYTHON names
another such Python. Where there is none, those tests skip and say why. Then tests/clusters: jobs that cluster
environments start (torchrun...) on several backends; its pytest process imports no framework.
Suites run in two lanes at once (DISTKERAS_TEST_LANES, default 2; 1 runs them one after another), each lane one
suite at a time, each suite's output printed whole when it ends. Prints one closing line, "tests: N passed,
N failed, N skipped in S s", and exits non-zero if any suite failed or errored. Extra arguments go to every pytest run (e.g. -k, -x). DISTKERAS_SUITES=a,b runs only the named
suites; DISTKERAS_TESTS=path,path (test files or folders) runs only those, each in the suites whose paths hold
it, and skips the suites that hold none. DISTKERAS_JUNIT_DIR=dir keeps each suite's JUnit XML (every test's time) there.
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


#: Seconds each suite took in the last full run (two lanes at once on a 2-core CPU machine), to balance the lanes.
EXPECTED_S = {"core": 265, "tensorflow": 1600, "jax": 1400, "torch": 880, "mxnet": 120, "cntk": 155, "clusters": 620}


def lanes(names, count):
    """``names`` dealt into ``count`` lanes of about equal expected time (longest first, each to the lightest
    lane), each lane keeping the suites' order in SUITES."""
    load, dealt = [0] * count, [[] for _ in range(count)]
    for name in sorted(names, key=lambda n: -EXPECTED_S.get(n, 300)):
        lightest = load.index(min(load))
        dealt[lightest].append(name)
        load[lightest] += EXPECTED_S.get(name, 300)
    return [[n for n in names if n in lane] for lane in dealt if lane]


def run_suite(name, env, paths, python, argv, tmp, out):
    """One suite in its own pytest process; its output goes to ``out``. Returns (counts, exit code, seconds)."""
    junit = os.path.join(tmp, name + ".xml")
    out.write("\n==== suite: {} ====\n".format(name))
    out.flush()
    if python is not None and not os.path.exists(python):
        out.write("==== suite {}: no interpreter at {}; run scripts/mxnet-env.sh (scripts/test.sh does)\n".format(
            name, os.path.relpath(python, ROOT)))
        return {"passed": 0, "failed": 0, "skipped": 0}, None, 0.0
    started = time.time()
    code = subprocess.call(
        [python or sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--junitxml", junit,
         "--durations=15", *paths, *argv],
        cwd=ROOT, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
    )
    got = count(junit)
    took = time.time() - started
    out.write("==== suite {}: {passed} passed, {failed} failed, {skipped} skipped in {:.0f}s (exit {})\n".format(
        name, took, code, **got))
    return got, code, took


def main(argv):
    """Run the suites; with DISTKERAS_TEST_LANES=N (default 2) in N lanes at once, each lane one suite at a time.

    Each suite is still its own pytest process (Keras fixes its backend at import). On a 2-core machine one suite
    keeps about one core busy on average (its workers start, import a framework and wait on each other in turn),
    so two lanes finish in much less time than one. Each suite's output is printed whole when it ends.
    """
    import threading

    only = os.environ.get("DISTKERAS_SUITES", "").split(",") if os.environ.get("DISTKERAS_SUITES") else None
    wanted = os.environ.get("DISTKERAS_TESTS", "").split(",") if os.environ.get("DISTKERAS_TESTS") else None
    count_lanes = max(1, int(os.environ.get("DISTKERAS_TEST_LANES", "2") or 2))
    chosen = {}
    for name, env, paths, python in SUITES:
        if only and name not in only:
            continue
        if wanted:
            paths = restrict(paths, wanted)
            if paths is None:
                continue
        chosen[name] = (env, paths, python)
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    failed_suites = []
    lock = threading.Lock()
    started = time.time()

    def run_lane(names, tmp, live):
        for name in names:
            if live:  # one lane: the output as it comes
                got, code, _ = run_suite(name, *chosen[name], argv, tmp, sys.stdout)
            else:
                with tempfile.TemporaryFile("w+") as out:
                    got, code, _ = run_suite(name, *chosen[name], argv, tmp, out)
                    out.seek(0)
                    with lock:
                        sys.stdout.write(out.read())
                        sys.stdout.flush()
            with lock:
                for key in totals:
                    totals[key] += got[key]
                if code is None or code not in (0, 5) or got["failed"]:
                    failed_suites.append(name)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = os.environ.get("DISTKERAS_JUNIT_DIR") or tmp
        os.makedirs(tmp, exist_ok=True)
        dealt = lanes(list(chosen), count_lanes)
        if len(dealt) > 1:
            print("running {} lanes at once: {}".format(len(dealt), "; ".join(", ".join(lane) for lane in dealt)),
                  flush=True)
        threads = [threading.Thread(target=run_lane, args=(lane, tmp, len(dealt) == 1)) for lane in dealt]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if failed_suites:
        print("failed suites: " + ", ".join(sorted(failed_suites)))
    print("tests: {passed} passed, {failed} failed, {skipped} skipped in {:.0f}s".format(time.time() - started,
                                                                                        **totals))
    return 1 if failed_suites or totals["passed"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
