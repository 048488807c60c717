"""A real two-node Slurm cluster (tests/clusters/slurm.py) starts distkeras jobs with no launcher:

- ``srun -N2 -n2`` and ``srun -N2 --ntasks-per-node=2`` on TensorFlow, JAX and PyTorch, each train
  what one process trains at the same global batch, with the replica count read from the framework (the
  default run takes each backend at one layout, both layouts in all; DISTKERAS_FULL_TESTS=1 the whole matrix);
- a SIGKILLed task ends the step (``--kill-on-bad-exit``) within 45 s;
- a requeued job (``sbatch --requeue``, then ``scontrol requeue`` mid-epoch: Slurm's SIGTERM) checkpoints the step
  its tasks stopped after and resumes there;
- ``srun --ntasks-per-node=1 distkeras launch --nproc-per-node 2`` takes its nodes, node rank and coordinator
  from Slurm;
- an sbatch script that runs ``python train.py`` for 2 tasks, without srun, stops with a ClusterError;
- the hostlist expander agrees with ``scontrol show hostnames``, and every task reads its place as srun set it.

Besides the srun matrix the jobs run on JAX, whose processes start quickest. The reference is one device's
training at the same global batch: SGD with momentum on the job's own initial weights (tests.clusters.slurm_job
saves them), computed here with numpy; test_the_reference_is_one_keras_process checks it against a real single
Keras process. This pytest process imports no framework; each job sets
KERAS_BACKEND. Skipped, saying why, where Slurm can't be installed or namespaces can't be made (not root).
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import full
from tests.clusters import slurm as slurm_cluster_lib
from distkeras.environments.slurm import expand_hostlist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = ["-m", "tests.clusters.slurm_job"]
TIMEOUT = 300
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


@pytest.fixture(scope="session")
def slurm_cluster():
    yield from slurm_cluster_lib.cluster_fixture()


@pytest.fixture(autouse=True)
def no_job_left(request):
    yield
    if "slurm_cluster" in request.fixturenames:
        request.getfixturevalue("slurm_cluster").cancel_all()


def job_env(cluster, backend, **extra):
    """The environment srun passes on to every task (--export=ALL): one CPU device per task."""
    env = cluster.env(KERAS_BACKEND=backend, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT]),
                      PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    unwanted = ("XLA_FLAGS", "TF_CONFIG", "CUDA_VISIBLE_DEVICES")
    for name in [n for n in env if n.startswith("DISTKERAS_") or n in unwanted]:
        del env[name]
    env.update(extra)
    return env


def run(cluster, args, env, timeout=TIMEOUT):
    started = time.time()
    done = cluster.run(args, timeout=timeout, env=env, cwd=ROOT, check=False)
    return done, time.time() - started


def reference(init, epochs=4, batch=12, lr=0.05, momentum=0.9):
    """One device's training, in numpy: Dense(16, tanh) -> Dense(3), MSE, SGD with momentum (Keras' update:
    m = momentum * m - lr * g; w += m), 100 samples in batches of 12 (the last one of 4), no shuffling."""
    from tests.backends import scenarios  # numpy only

    x, y = (a.astype("float64") for a in scenarios.data(100))
    w = [np.array(a, dtype="float64") for a in init]
    m = [np.zeros_like(a) for a in w]
    for _ in range(epochs):
        for start in range(0, len(x), batch):
            xb, yb = x[start:start + batch], y[start:start + batch]
            h = np.tanh(xb @ w[0] + w[1])
            out = h @ w[2] + w[3]
            g_out = 2.0 * (out - yb) / out.size
            g_h = (g_out @ w[2].T) * (1.0 - h ** 2)
            grads = [xb.T @ g_h, g_h.sum(0), h.T @ g_out, g_out.sum(0)]
            for i, g in enumerate(grads):
                m[i] = momentum * m[i] - lr * g
                w[i] = w[i] + m[i]
    return w


def load(path):
    saved = np.load(path)
    return [saved["arr_{}".format(i)] for i in range(len(saved.files))]


def check_trained_as_one_process(out_dir, world, output):
    """Every rank's weights are identical and equal one device's; the framework counts ``world`` replicas."""
    ranks = [load(os.path.join(out_dir, "rank{}.npz".format(r))) for r in range(world)]
    for other in ranks[1:]:
        for a, b in zip(ranks[0], other):
            np.testing.assert_array_equal(a, b)
    expected = reference(load(os.path.join(out_dir, "init.npz")))
    for e, a in zip(expected, ranks[0]):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5, err_msg=output[-3000:])
    reports = [json.load(open(os.path.join(out_dir, "rank{}.json".format(r)))) for r in range(world)]
    assert [r["replicas"] for r in reports] == [world] * world, reports
    # The data check, on by default in a job, compared the workers' batches at each epoch this run trained.
    assert [r["data_checks"] for r in reports] == [len(r["epochs"]) for r in reports], reports
    return reports


def test_hostlists_expand_as_scontrol_shows_them(slurm_cluster):
    cluster = slurm_cluster
    cases = ["gpu-a[01-04,07],gpu-b3", "n[8-11]", "n[008-011]", "a[1-2]b[3-4]", "a[1-2]-[5-6],z[1,3]",
             "rack1-n[1-2]", "n[01-3]", "n[1-03]", "n1[2-3]", "x[9-10],y", "n[2,1]", "n[0-3],n[2-5]", "n0 n1",
             "a[1,2]b[3]c[4-5]", "node[1-100]"]
    for text in cases:
        shown = cluster.run(["scontrol", "show", "hostnames", text], timeout=30).stdout.split()
        assert expand_hostlist(text) == shown, text


def test_every_task_reads_its_place_as_srun_set_it(slurm_cluster, tmp_path):
    cluster = slurm_cluster
    code = ("import json, os; from distkeras import cluster; c = cluster.from_env(); "
            "print(json.dumps([c.rank, c.world_size, c.local_rank, c.local_world_size, c.coordinator, c.source, "
            "list(c.workers), os.environ['SLURMD_NODENAME']]))")
    done, _ = run(cluster, ["srun", "-N2", "--ntasks-per-node=2", sys.executable, "-c", code],
                  job_env(cluster, "torch", DISTKERAS_COORDINATOR_PORT="23456"), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = sorted(json.loads(line) for line in done.stdout.splitlines() if line.startswith("["))
    workers = ["n0:23457", "n0:23458", "n1:23457", "n1:23458"]
    assert seen == [[r, 4, r % 2, 2, "n0:23456", "slurm", workers, "n{}".format(r // 2)] for r in range(4)]


#: Why the default run takes each backend at one srun layout (the full run, DISTKERAS_FULL_TESTS=1, at both).
ONE_LAYOUT = {
    "jax-N2n2": "JAX on -N2 -n2 trains as one process in test_a_requeued_job_resumes and the example's test",
    "torch-N2n2": "PyTorch joins the same way at 2 and 4 tasks: torch-N2-2pernode runs",
    "tensorflow-N2-2pernode": "the TF_CONFIG of 2 tasks per node is test_every_task_reads_its_place_as_srun_set_it's; "
                              "TensorFlow forming its job from what distkeras wrote is tensorflow-N2n2's",
}


@pytest.mark.parametrize("backend,layout", [
    pytest.param(backend, layout, id=name, marks=[full.only_in_full(ONE_LAYOUT[name])] if name in ONE_LAYOUT else [])
    for name, backend, layout in [
        ("tensorflow-N2n2", "tensorflow", ["-N2", "-n2"]),
        ("jax-N2n2", "jax", ["-N2", "-n2"]),
        ("torch-N2n2", "torch", ["-N2", "-n2"]),
        ("tensorflow-N2-2pernode", "tensorflow", ["-N2", "--ntasks-per-node=2"]),
        ("jax-N2-2pernode", "jax", ["-N2", "--ntasks-per-node=2"]),
        ("torch-N2-2pernode", "torch", ["-N2", "--ntasks-per-node=2"]),
    ]
])
def test_srun_trains_as_one_process(slurm_cluster, tmp_path, backend, layout):
    cluster = slurm_cluster
    done, seconds = run(cluster, ["srun"] + layout + ["--kill-on-bad-exit=1", sys.executable] + JOB +
                        [str(tmp_path), "train"], job_env(cluster, backend))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:] + cluster.logs()
    world = 2 if "-n2" in layout else 4
    reports = check_trained_as_one_process(str(tmp_path), world, output)
    assert [r["local_rank"] for r in reports] == ([0, 0] if world == 2 else [0, 1, 0, 1])
    assert {r["source"] for r in reports} == {"slurm"}  # also on TensorFlow, whose TF_CONFIG distkeras wrote
    assert "Epoch 4/4" in done.stdout and done.stdout.count("Epoch 4/4") == 1  # rank 0 speaks, alone
    print("{} {}: {:.1f} s".format(backend, " ".join(layout), seconds))


def test_a_killed_task_ends_the_step(slurm_cluster, tmp_path):
    cluster = slurm_cluster
    done, seconds = run(cluster, ["srun", "-N2", "-n2", "--kill-on-bad-exit=1", sys.executable] + JOB +
                        [str(tmp_path), "kill"], job_env(cluster, "jax"), timeout=180)
    ended = time.time()
    assert done.returncode != 0
    killed_at = float(open(os.path.join(str(tmp_path), "killed-at")).read())
    assert ended - killed_at < 45, (ended - killed_at, done.stderr[-3000:])
    assert "task 1: Killed" in done.stderr, done.stderr[-3000:]
    assert not os.path.exists(os.path.join(str(tmp_path), "rank0.npz"))
    print("step ended {:.1f} s after rank 1 was killed".format(ended - killed_at))


def job_state(cluster, job):
    shown = cluster.run(["scontrol", "show", "job", job], timeout=30, check=False).stdout
    fields = dict(w.split("=", 1) for w in shown.split() if "=" in w)
    return fields.get("JobState"), fields.get("Restarts"), fields.get("ExitCode")


def wait_for(condition, timeout, what, cluster):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError("no {} after {} s\n{}".format(what, timeout, cluster.logs()))


def test_a_requeued_job_resumes(slurm_cluster, tmp_path):
    cluster = slurm_cluster
    out = str(tmp_path)
    script = tmp_path / "train.sbatch"
    script.write_text("#!/bin/sh\nexec srun --kill-on-bad-exit=1 {} {} {} requeue\n".format(
        sys.executable, " ".join(JOB), out))
    env = job_env(cluster, "jax")
    done = cluster.run(["sbatch", "--parsable", "--requeue", "-N2", "-n2", "--open-mode=append",
                        "-o", os.path.join(out, "job.out"), str(script)], timeout=30, env=env, cwd=ROOT)
    job = done.stdout.strip().split(";")[0]
    wait_for(lambda: os.path.exists(os.path.join(out, "paused")), TIMEOUT, "epoch 2 under way", cluster)
    cluster.run(["scontrol", "requeue", job], timeout=30)
    # Slurm makes a requeued job eligible 120 s later; this test doesn't wait for that.
    wait_for(lambda: job_state(cluster, job)[0] == "PENDING", 60, "requeued job pending", cluster)
    # The requeue's SIGTERM was a preemption: every task stopped after the same step of epoch 2, checkpointed.
    with open(os.path.join(out, "ckpt", "checkpoint.json")) as f:
        manifest = json.load(f)
    assert manifest["epoch"] == 1 and manifest["step"] >= 3, manifest
    cluster.run(["scontrol", "update", "JobId=" + job, "StartTime=now"], timeout=30)
    wait_for(lambda: job_state(cluster, job)[0] in ENDED, TIMEOUT,
             "end of the requeued job", cluster)
    log = open(os.path.join(out, "job.out")).read()
    assert job_state(cluster, job) == ("COMPLETED", "1", "0:0"), log[-5000:]
    assert "DUE TO JOB REQUEUE" in log
    reports = check_trained_as_one_process(out, 2, log)
    # The second run began in epoch 2, at the step the first run's tasks agreed to stop after.
    assert [(r["restart"], r["epochs"]) for r in reports] == [("1", [1, 2, 3])] * 2
    assert "preempted (SIGTERM): saved epoch 2 step {}".format(manifest["step"]) in log


def test_distkeras_launch_inside_an_allocation(slurm_cluster, tmp_path):
    cluster = slurm_cluster
    command = ["srun", "-N2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", sys.executable, "-m", "distkeras",
               "launch", "--nproc-per-node", "2", "--stop-timeout", "10"] + JOB + [str(tmp_path), "train"]
    done, seconds = run(cluster, command, job_env(cluster, "jax"))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    reports = check_trained_as_one_process(str(tmp_path), 4, output)
    # The launcher's variables describe its workers; Slurm's described the launchers (nodes, node rank).
    assert [(r["source"], r["world_size"], r["local_rank"]) for r in reports] == [
        ("distkeras", 4, 0), ("distkeras", 4, 1), ("distkeras", 4, 0), ("distkeras", 4, 1)]
    print("srun + distkeras launch, 2 nodes x 2 workers: {:.1f} s".format(seconds))


def test_a_batch_script_without_srun_is_an_error(slurm_cluster, tmp_path):
    cluster = slurm_cluster
    out = str(tmp_path)
    script = tmp_path / "train.sbatch"
    script.write_text("#!/bin/sh\n{} {} {} train\n".format(sys.executable, " ".join(JOB), out))
    done = cluster.run(["sbatch", "--parsable", "-N2", "--ntasks", "2", "-o", os.path.join(out, "job.out"),
                        str(script)], timeout=30, env=job_env(cluster, "jax"), cwd=ROOT)
    job = done.stdout.strip().split(";")[0]
    # polled here: sbatch --wait checks back only every few tens of seconds
    wait_for(lambda: job_state(cluster, job)[0] in ENDED, TIMEOUT, "end of the batch job", cluster)
    log = open(os.path.join(out, "job.out")).read()
    assert job_state(cluster, job)[0] == "FAILED", log
    assert "ClusterError" in log and "run it with srun" in log and "SLURM_NTASKS=2" in log, log[-3000:]
    assert "DISTKERAS_ENVIRONMENT=single" in log
    assert not [f for f in os.listdir(out) if f.startswith("rank")]  # it trained nothing, alone or not


def test_the_reference_is_one_keras_process(tmp_path):
    # The numpy reference above against real Keras training in one process.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DISTKERAS_")) and k != "XLA_FLAGS"}
    env.update(KERAS_BACKEND="jax", PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT]))
    done = subprocess.run([sys.executable] + JOB + [str(tmp_path), "single"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = reference(load(os.path.join(str(tmp_path), "init.npz")))
    for e, a in zip(expected, load(os.path.join(str(tmp_path), "single.npz"))):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)


def test_the_slurm_example_trains(slurm_cluster, tmp_path):
    cluster = slurm_cluster
    # examples/slurm/train.py as train.sbatch runs it (srun python train.py), on CPUs and with little data.
    out = str(tmp_path)
    command = ["srun", "-N2", "-n2", "--kill-on-bad-exit=1", sys.executable, os.path.join(ROOT, "examples", "slurm",
               "train.py"), "--epochs", "2", "--samples", "512", "--batch-size", "64", "--backup",
               os.path.join(out, "backup"), "--out", os.path.join(out, "model.keras")]
    done, seconds = run(cluster, command, job_env(cluster, "jax"))
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    assert "'replicas': 2" in done.stdout and "'workers': 2" in done.stdout, done.stdout[-3000:]
    assert os.path.exists(os.path.join(out, "model.keras")) and done.stdout.count("saved ") == 1
    print("examples/slurm/train.py on 2 nodes: {:.1f} s".format(seconds))
