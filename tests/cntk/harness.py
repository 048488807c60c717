"""Runs test jobs for the CNTK suite: worker scripts in fresh processes that import the doubles
(``tests/cntk/doubles``) as ``cntk`` and ``keras``, one process, or N ranks under the fake mpiexec."""

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(ROOT, "src")
DOUBLES = os.path.join(ROOT, "tests", "cntk", "doubles")
MPIEXEC = os.path.join(DOUBLES, "bin", "mpiexec")


class Job(object):
    def __init__(self, done, folder):
        self.returncode, self.stdout, self.stderr = done.returncode, done.stdout, done.stderr
        self.results = {}
        for name in sorted(os.listdir(folder)):
            if name.startswith("result.") and name.endswith(".json"):
                with open(os.path.join(folder, name)) as handle:
                    self.results[int(name.split(".")[1])] = json.load(handle)

    def __repr__(self):
        return "Job(returncode={}, stderr=...{})".format(self.returncode, self.stderr[-3000:])


def environment(tmp_path, **extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([DOUBLES, SRC, ROOT]), KERAS_BACKEND="cntk",
               KERAS_HOME=str(tmp_path), RESULTS_DIR=str(tmp_path), FAKE_MPI_TIMEOUT="30")
    env["PATH"] = os.pathsep.join([os.path.dirname(MPIEXEC), env.get("PATH", "")])
    for name in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "FAKE_MPI_DIR", "RANK", "WORLD_SIZE",
                 "TF_CONFIG", "DISTKERAS_CPU_DEVICES"):
        env.pop(name, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(tmp_path, body, workers=None, command=None, timeout=180, **extra):
    """Run ``body`` (a script) as one process (``workers=None``), or as ``workers`` ranks under the fake
    mpiexec, or through ``command`` (a list, the script's path appended); returns a :class:`Job`."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(body))
    if command is not None:
        argv = list(command) + [str(script)]
    elif workers is None:
        argv = [sys.executable, str(script)]
    else:
        argv = [sys.executable, MPIEXEC, "-n", str(workers), sys.executable, str(script)]
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                          env=environment(tmp_path, **extra), cwd=str(tmp_path), timeout=timeout)
    return Job(done, str(tmp_path))
