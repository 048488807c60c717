"""`distkeras launch --backend cntk`, run with the CNTK runtime's Python, starts the workers as MPI ranks with
Open MPI's mpiexec."""

import os
import re
import shutil

import pytest

from tests.cntk.harness import PYTHON, needs_runtime, run

pytestmark = needs_runtime

LAUNCH = [PYTHON, "-m", "distkeras", "launch", "--backend", "cntk"]

WORKER = """
    import os, sys
    import distkeras
    from tests.cntk import toy
    x, y = toy.data(20)
    model = distkeras.distribute(toy.model(seed=toy.rank()))
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    sys.stdout.write("rank {} of {} {}\\n".format(os.environ["OMPI_COMM_WORLD_RANK"], os.environ["OMPI_COMM_WORLD_SIZE"],
                                                  os.environ["KERAS_BACKEND"]))  # one write: the ranks share a pipe
    toy.report(weights=model.get_weights())
"""


def test_launch_runs_n_ranks_under_mpiexec(tmp_path):
    job = run(tmp_path, WORKER, command=LAUNCH + ["--nproc-per-node", "2"], KERAS_BACKEND="tensorflow")
    assert job.returncode == 0, job
    # Only the worker's own lines (its stderr, CNTK's notes among it, shares the launcher's stdout).
    lines = sorted(line for line in job.stdout.splitlines() if re.search(r"rank \d+ of \d+ cntk$", line))
    assert lines == ["[rank mpi] rank 0 of 2 cntk", "[rank mpi] rank 1 of 2 cntk"]  # KERAS_BACKEND set by launch
    assert job.results[0]["weights"] == job.results[1]["weights"]
    assert "warning" not in job.stderr


def test_one_rank_is_launched_with_a_warning(tmp_path):
    job = run(tmp_path, WORKER, command=LAUNCH + ["--nproc-per-node", "1"])
    assert job.returncode == 0, job
    assert "distkeras launch: warning: one MPI rank; CNTK trains it as a local learner" in job.stderr
    assert "this mpi job has one worker" in job.stdout  # a rank's stderr: under the launcher, on its stdout


def test_a_failing_rank_fails_the_launch(tmp_path):
    body = """
        import os, sys
        sys.exit(3 if os.environ["OMPI_COMM_WORLD_RANK"] == "1" else 0)
    """
    job = run(tmp_path, body, command=LAUNCH + ["--nproc-per-node", "2"])
    assert job.returncode == 3, job
    assert "rank mpi died (exit code 3)" in job.stderr


def test_without_mpiexec_launch_says_what_to_install(tmp_path):
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and not shutil.which("mpiexec", path=p))
    job = run(tmp_path, WORKER, command=LAUNCH + ["--nproc-per-node", "2"], PATH=path)
    assert job.returncode == 2, job
    assert ("distkeras: error: The cntk backend runs its workers as MPI ranks, and mpiexec is not on PATH. Install Open MPI "
            "(Debian/Ubuntu: openmpi-bin libopenmpi3; CNTK 2.7 then needs two links to its 1.10 sonames, which "
            "scripts/cntk-env.sh makes) or run mpiexec yourself.") in job.stderr


@pytest.mark.parametrize("args", [["--nnodes", "2", "--node-rank", "0", "--coordinator", "10.0.0.1:29500"]])
def test_several_hosts_point_to_mpiexec_and_a_host_file(tmp_path, args):
    job = run(tmp_path, WORKER, command=LAUNCH + ["--nproc-per-node", "2"] + args)
    assert job.returncode == 2, job
    assert "For CNTK across hosts, run mpiexec with your host file: mpiexec -n N --hostfile hosts python script.py" in job.stderr
