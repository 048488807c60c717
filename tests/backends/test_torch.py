"""What only the PyTorch adapter has: replicas that are processes.

Real torch.distributed (gloo on 127.0.0.1), no mocks. Bodies run on every rank of a worker job
(``harness.job``); scripts run as plain ``python script.py`` and launch their own workers. Every wait has
a hard timeout, and every process a test starts is killed when it ends.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.backends.harness import BACKEND, job, keras
from tests.backends import scenarios

import distkeras

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="PyTorch adapter tests (KERAS_BACKEND=torch)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Hard limit for one multi-process run (start-up of every process included).
TIMEOUT = 240


def max_difference(expected, actual):
    return max(float(np.abs(np.asarray(a) - np.asarray(e)).max()) for e, a in zip(expected, actual))


# ---- bodies run on every rank of a job


def fit_verbose(devices):
    model = distkeras.distribute(scenarios.build(keras), devices=devices)
    x, y = scenarios.data(48)
    model.fit(x, y, batch_size=12, epochs=2, verbose=1, validation_split=0.25)
    model.evaluate(x, y, batch_size=12)
    model.predict(x, batch_size=12)


def uneven(devices, samples, batch, epochs=2):
    """Single-device and distributed weights for a data set / batch that leaves some ranks empty."""
    x, y = scenarios.data(samples)
    single = scenarios.build(keras)
    single.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    model = distkeras.distribute(scenarios.build(keras), devices=devices)
    history = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, validation_data=(x, y))
    logs = model.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)
    return single.get_weights(), model.get_weights(), history.history, logs


def shuffled(devices):
    """fit(shuffle=True) from the same torch seed: single-device and distributed weights."""
    import torch

    x, y = scenarios.data(60)
    single = scenarios.build(keras)
    torch.manual_seed(123)
    single.fit(x, y, batch_size=12, epochs=3, verbose=0)
    model = distkeras.distribute(scenarios.build(keras), devices=devices)
    torch.manual_seed(123)
    model.fit(x, y, batch_size=12, epochs=3, verbose=0)
    return single.get_weights(), model.get_weights()


def from_loader(devices, kind):
    """fit() on a torch DataLoader or a keras PyDataset (batches of 10): single-device and distributed weights."""
    import torch

    x, y = scenarios.data(53)

    def source():
        if kind == "dataloader":
            dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
            return torch.utils.data.DataLoader(dataset, batch_size=10, shuffle=False)

        class Batches(keras.utils.PyDataset):
            def __len__(self):
                return -(-len(x) // 10)

            def __getitem__(self, index):
                return x[index * 10 : (index + 1) * 10], y[index * 10 : (index + 1) * 10]

        return Batches()

    single = scenarios.build(keras)
    single.fit(source(), epochs=2, verbose=0)
    model = distkeras.distribute(scenarios.build(keras), devices=devices)
    model.fit(source(), epochs=2, verbose=0)
    return single.get_weights(), model.get_weights()


def wrong_device_count(devices):
    try:
        distkeras.distribute(scenarios.build(keras), devices=devices)
    except distkeras.DistKerasError as exc:
        return exc
    return None


def failed_save(devices, directory):
    """Rank 0 can't write (a bad file name); every rank's error."""
    model = distkeras.distribute(scenarios.build(keras), devices=devices)
    try:
        model.save(os.path.join(directory, "model.unknown-suffix"))
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def threads_after_distribute(devices, omp):
    """torch's threads in this rank after distribute(), from as many as the machine has cores."""
    import torch

    os.environ.pop("OMP_NUM_THREADS", None)
    if omp:
        os.environ["OMP_NUM_THREADS"] = str(omp)
    torch.set_num_threads(os.cpu_count())
    distkeras.distribute(scenarios.build(keras), devices=devices)
    return torch.get_num_threads(), len(os.sched_getaffinity(0))


# ---- jobs of worker processes


def test_cpu_processes_share_the_cores():
    """N processes on one CPU: cores // N threads each, not N times the cores; OMP_NUM_THREADS is kept."""
    for threads, cores in (o.result for o in job(2).run(threads_after_distribute, 2, None, timeout=TIMEOUT)):
        assert threads == max(1, cores // 2)
    for threads, cores in (o.result for o in job(2).run(threads_after_distribute, 2, 3, timeout=TIMEOUT)):
        assert threads == os.cpu_count()


def test_every_rank_ends_with_identical_weights():
    outcomes = job(3).run(scenarios.train, "batch_not_divisible", 3, timeout=TIMEOUT)
    (weights, history), others = outcomes[0].result, outcomes[1:]
    for other in others:
        other_weights, other_history = other.result
        for mine, theirs in zip(weights, other_weights):
            np.testing.assert_array_equal(mine, theirs)  # bit for bit: every rank applies the same average
        assert other_history == history


def test_only_rank0_prints():
    outcomes = job(2).run(fit_verbose, 2, timeout=TIMEOUT)
    assert "Epoch 2/2" in outcomes[0].stdout and "val_loss" in outcomes[0].stdout
    assert "distkeras: torch backend, 2 replica(s)" in outcomes[0].stderr
    assert outcomes[1].stdout == ""
    assert "distkeras" not in outcomes[1].stderr and "Epoch" not in outcomes[1].stderr


@pytest.mark.parametrize(
    "samples,batch",
    [
        (7, 5),  # last batch of 2 on 3 ranks: rank 2 has nothing in that step
        (5, 1),  # global batch 1: two ranks empty in every step
        (2, 4),  # fewer samples than ranks: rank 2 never gets one
    ],
)
def test_uneven_data_never_deadlocks_and_stays_exact(samples, batch):
    single, weights, history, logs = job(3).run(uneven, 3, samples, batch, timeout=TIMEOUT)[0].result
    assert max_difference(single, weights) < 1e-5
    assert len(history["loss"]) == 2 and set(logs) == {"loss", "mae"}


def test_shuffled_fit_uses_the_same_global_batches():
    single, weights = job(2).run(shuffled, 2, timeout=TIMEOUT)[0].result
    assert max_difference(single, weights) < 1e-5


@pytest.mark.parametrize("kind", ["dataloader", "pydataset"])
def test_data_loaders_split_each_batch(kind):
    single, weights = job(3).run(from_loader, 3, kind, timeout=TIMEOUT)[0].result
    assert max_difference(single, weights) < 1e-5


def test_device_count_must_match_the_launched_processes():
    error = job(2).run(wrong_device_count, 3, timeout=TIMEOUT)[0].result
    assert isinstance(error, distkeras.DistKerasError)
    assert "started 2 process(es) on this host" in str(error) and "3 device(s)" in str(error)


def test_a_failed_save_on_rank0_fails_every_rank(tmp_path):
    outcomes = job(2).run(failed_save, 2, str(tmp_path), timeout=TIMEOUT)
    assert outcomes[0].result[0] == "ValueError"
    assert outcomes[1].result[0] == "DistKerasError" and "Rank 0 could not write" in outcomes[1].result[1]
    assert os.listdir(tmp_path) == []


def test_two_hosts_of_two_processes():
    # 4 processes as 2 simulated hosts: the rendezvous doesn't care where the ranks are.
    outcomes = job(4, local_size=2).run(scenarios.describe, 2, timeout=TIMEOUT)
    assert [o.result["rank"] for o in outcomes] == [0, 1, 2, 3]
    assert outcomes[0].result["replicas"] == 4 and outcomes[0].result["workers"] == 2
    expected, _ = scenarios.train("batch_not_divisible", 1)
    weights, _ = job(4, local_size=2).run(scenarios.train, "batch_not_divisible", 2, timeout=TIMEOUT)[0].result
    assert max_difference(expected, weights) < 1e-5


# ---- plain scripts that launch their own workers


def run_script(tmp_path, source, *args, timeout=TIMEOUT, from_stdin=False):
    """Run ``python script.py`` (or ``python -``) as a user would, without launcher variables; kill its
    process group afterwards. Returns (exit code, stdout, stderr)."""
    script = tmp_path / "script.py"
    script.write_text(source)
    command = [sys.executable, "-" if from_stdin else str(script)] + [str(a) for a in args]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), ROOT])
    proc = subprocess.Popen(
        command, cwd=str(tmp_path), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        # Returns once every process holding the output pipes is gone: rank 0 and the workers it started.
        stdout, stderr = proc.communicate(source if from_stdin else "", timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail("the script did not finish within {} s:\n{}".format(timeout, stderr[-3000:]))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, stdout, stderr


def gone(pid):
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


_TRAIN = """
import json, os, sys
import numpy as np
import keras
import distkeras
from tests.backends import scenarios

expected, _ = scenarios.train("batch_not_divisible", 1)
weights, history = scenarios.train("batch_not_divisible", 2)
with open(os.path.join(sys.argv[1], "rank{}.json".format(os.environ["RANK"])), "w") as out:
    json.dump({"pid": os.getpid(), "ppid": os.getppid(), "world": int(os.environ["WORLD_SIZE"]),
               "difference": max(float(np.abs(a - b).max()) for a, b in zip(expected, weights)),
               "loss": history["loss"]}, out)
"""


def test_plain_script_launches_its_own_workers(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    code, _, stderr = run_script(tmp_path, _TRAIN, out)
    assert code == 0, stderr[-3000:]
    assert sorted(os.listdir(out)) == ["rank0.json", "rank1.json"]
    ranks = [json.loads((out / name).read_text()) for name in ("rank0.json", "rank1.json")]
    assert ranks[1]["ppid"] == ranks[0]["pid"]  # rank 0 started rank 1
    assert [r["world"] for r in ranks] == [2, 2]
    assert all(r["difference"] < 1e-5 for r in ranks)
    assert ranks[0]["loss"] == ranks[1]["loss"]
    assert stderr.count("distkeras: torch backend, 2 replica(s)") == 1


_CHILD_DIES = """
import os
import keras
import distkeras
from tests.backends import scenarios

class Die(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if os.environ["RANK"] == "1":
            os._exit(3)

model = distkeras.distribute(scenarios.build(keras), devices=2)
x, y = scenarios.data(96)
model.fit(x, y, batch_size=12, epochs=50, verbose=0, callbacks=[Die()])
print("rank", os.environ["RANK"], "finished")
"""


def test_a_dying_worker_ends_the_job_naming_its_rank(tmp_path):
    code, stdout, stderr = run_script(tmp_path, _CHILD_DIES)
    assert code != 0
    assert "finished" not in stdout
    assert "worker rank 1" in stderr and "exited with code 3" in stderr
    assert "LaunchError" in stderr


_PARENT_DIES = """
import os, signal, sys, time
import keras
import distkeras
from tests.backends import scenarios

model = distkeras.distribute(scenarios.build(keras), devices=2)
folder = sys.argv[1]
with open(os.path.join(folder, "rank{}.pid".format(os.environ["RANK"])), "w") as out:
    out.write(str(os.getpid()))
if os.environ["RANK"] == "0":
    deadline = time.time() + 60
    while not os.path.exists(os.path.join(folder, "rank1.pid")) and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(300)
"""


def test_workers_die_with_their_parent(tmp_path):
    code, _, stderr = run_script(tmp_path, _PARENT_DIES, tmp_path)
    assert code == -signal.SIGKILL, stderr[-3000:]
    child = int((tmp_path / "rank1.pid").read_text())
    deadline = time.monotonic() + 30
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not gone(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail("rank 1 (pid {}) outlived its parent by 30 s".format(child))


def test_a_program_from_stdin_is_told_how_to_launch(tmp_path):
    code, _, stderr = run_script(tmp_path, _TRAIN, tmp_path, from_stdin=True)
    assert code != 0
    assert "LaunchError" in stderr and "not a script file" in stderr
    assert "torchrun --nproc-per-node 2 script.py" in stderr


def test_distribute_inside_a_test_run_says_how_to_launch():
    # In this pytest process there is no launcher, and re-running the test run per device would be wrong.
    with pytest.raises(distkeras.LaunchError, match=r"distkeras launch --nproc-per-node 2 script.py.*torchrun"):
        distkeras.distribute(scenarios.build(keras), devices=2)
