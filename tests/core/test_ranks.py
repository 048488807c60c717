"""distkeras.is_main_process() and distkeras.print0(): the rank as distribute() reads it, no framework needed."""

import os
import subprocess
import sys

import pytest

import distkeras
from distkeras import ClusterError

LAUNCHED = {"DISTKERAS_LAUNCHER_PID": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}
SCHEDULERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG",
              "DISTKERAS_LAUNCHER_PID", "DISTKERAS_ENVIRONMENT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID",
              "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "JAX_PROCESS_ID",
              "JAX_NUM_PROCESSES", "JAX_COORDINATOR_ADDRESS", "TORCHELASTIC_RUN_ID", "JOB_COMPLETION_INDEX")


@pytest.fixture
def alone(monkeypatch):
    for name in SCHEDULERS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_one_process_is_the_main_process_and_prints(alone, capsys):
    assert distkeras.is_main_process() is True
    distkeras.print0("a", 1, sep="-", end="!\n")
    distkeras.print0("to stderr", file=sys.stderr)
    assert capsys.readouterr() == ("a-1!\n", "to stderr\n")


@pytest.mark.parametrize("rank", [0, 1])
def test_under_a_launcher_rank_0_alone_is_main_and_prints(alone, capsys, rank):
    for name, value in dict(LAUNCHED, RANK=str(rank), LOCAL_RANK=str(rank)).items():
        alone.setenv(name, value)
    assert distkeras.is_main_process() is (rank == 0)
    distkeras.print0("hello")
    assert capsys.readouterr().out == ("hello\n" if rank == 0 else "")


def test_an_environment_distribute_would_refuse_is_refused_here_too(alone):
    for name, value in dict(LAUNCHED, RANK="5", LOCAL_RANK="0").items():  # rank 5 of 2
        alone.setenv(name, value)
    with pytest.raises(ClusterError):
        distkeras.is_main_process()


def test_the_helpers_import_no_framework():
    done = subprocess.run([sys.executable, "-c", "import sys, distkeras; distkeras.print0('x'); "
                           "print(sorted(m for m in ('tensorflow', 'jax', 'torch', 'keras') if m in sys.modules))"],
                          capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k not in SCHEDULERS})
    assert done.stdout.splitlines() == ["x", "[]"], done.stderr


def test_rank_size_local_rank_local_size_are_the_launchers_and_the_schedulers(alone):
    """Issue 48: the names Horovod and torch users call (hvd.rank(), hvd.size(), hvd.local_rank()...)."""
    assert (distkeras.rank(), distkeras.size(), distkeras.local_rank(), distkeras.local_size()) == (0, 1, 0, 1)
    for name, value in dict(LAUNCHED, RANK="1", LOCAL_RANK="1").items():  # distkeras launch / torchrun
        alone.setenv(name, value)
    assert (distkeras.rank(), distkeras.size(), distkeras.local_rank(), distkeras.local_size()) == (1, 2, 1, 2)
    for name in LAUNCHED:
        alone.delenv(name, raising=False)
    alone.delenv("RANK")
    alone.delenv("LOCAL_RANK")
    # Slurm: 4 tasks on 2 nodes, this one the third
    for name, value in {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "7",
                        "SLURM_STEP_ID": "0", "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "2", "SLURM_NNODES": "2",
                        "SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NODELIST": "n[1-2]",
                        "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
                        "SLURM_TASKS_PER_NODE": "2(x2)"}.items():
        alone.setenv(name, value)
    assert (distkeras.rank(), distkeras.size(), distkeras.local_rank(), distkeras.local_size()) == (2, 4, 0, 2)
