"""`distkeras launch` with plain-Python workers (no framework): env, output, failures, signals, bad input.
Everything binds to 127.0.0.1, runs under a hard timeout, and leaves no process behind."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from distkeras import LaunchError, launch

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")


def distkeras_launch(tmp_path, worker_body, *launch_args, timeout=60, **popen):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(worker_body))
    env = dict(os.environ, PYTHONPATH=SRC, KERAS_HOME=str(tmp_path))
    env.pop("KERAS_BACKEND", None)
    command = [sys.executable, "-m", "distkeras", "launch", *launch_args, str(script)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path, **popen)


def finish(process, timeout=60):
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    return process.returncode, out, err


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open("/proc/{}/stat".format(pid)) as f:  # a zombie is dead too
        return f.read().split()[2] != "Z"


def test_workers_get_their_variables_and_every_line_its_rank(tmp_path):
    process = distkeras_launch(tmp_path, """
        import json, os, sys
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "JAX_PROCESS_ID", "JAX_NUM_PROCESSES"]
        print(json.dumps({k: os.environ[k] for k in keys + ["TF_CONFIG", "MASTER_PORT", "JAX_COORDINATOR_ADDRESS"]}))
        print("warning on stderr", file=sys.stderr)
    """, "--nproc-per-node", "3", "--backend", "tensorflow")
    code, out, err = finish(process)
    assert code == 0, err
    lines = sorted(out.splitlines())
    assert [line.split("] ")[0] for line in lines] == ["[rank 0", "[rank 1", "[rank 2"]
    seen = [json.loads(line.split("] ", 1)[1]) for line in lines]
    ports = {s["MASTER_PORT"] for s in seen}
    assert len(ports) == 1
    for rank, s in enumerate(seen):
        assert (s["RANK"], s["WORLD_SIZE"], s["LOCAL_RANK"], s["LOCAL_WORLD_SIZE"]) == (str(rank), "3", str(rank), "3")
        assert s["MASTER_ADDR"] == "127.0.0.1" and s["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:" + s["MASTER_PORT"]
        assert (s["JAX_PROCESS_ID"], s["JAX_NUM_PROCESSES"]) == (str(rank), "3")
        tf_config = json.loads(s["TF_CONFIG"])
        assert tf_config["task"] == {"type": "worker", "index": rank}
        assert len(tf_config["cluster"]["worker"]) == 3 and all(w.startswith("127.0.0.1:") for w in tf_config["cluster"]["worker"])
    assert sorted(err.splitlines()) == ["[rank {}] warning on stderr".format(r) for r in range(3)]


def test_a_dying_worker_stops_the_others_and_names_itself(tmp_path):
    started = time.time()
    process = distkeras_launch(tmp_path, """
        import os, time
        print(os.getpid(), flush=True)
        if os.environ["RANK"] == "1":
            time.sleep(1)
            os.kill(os.getpid(), 9)   # SIGKILL mid-"epoch"
        time.sleep(600)
    """, "--nproc-per-node", "3", "--stop-timeout", "5")
    code, out, err = finish(process, timeout=60)
    elapsed = time.time() - started
    assert code == 128 + 9
    assert "rank 1 died (killed by SIGKILL); stopping the other workers" in err
    assert elapsed < 20
    pids = [int(line.split("] ")[1]) for line in out.splitlines()]
    assert len(pids) == 3 and not any(alive(pid) for pid in pids)


def test_exit_code_of_the_first_failing_worker(tmp_path):
    process = distkeras_launch(tmp_path, """
        import os, sys, time
        if os.environ["RANK"] == "0":
            sys.exit(3)
        time.sleep(600)
    """, "--nproc-per-node", "2", "--stop-timeout", "5")
    code, _, err = finish(process)
    assert code == 3 and "rank 0 died (exit code 3)" in err


def test_a_worker_that_ignores_sigterm_is_killed_after_the_stop_timeout(tmp_path):
    started = time.time()
    process = distkeras_launch(tmp_path, """
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if os.environ["RANK"] == "1":
            time.sleep(1)
            sys.exit(5)
        time.sleep(600)
    """, "--nproc-per-node", "2", "--stop-timeout", "2")
    code, _, err = finish(process)
    assert code == 5 and "sending SIGKILL" in err
    assert time.time() - started < 20


def test_sigint_is_forwarded_to_every_worker(tmp_path):
    process = distkeras_launch(tmp_path, """
        import os, time
        try:
            print("ready", flush=True)  # inside the try: SIGINT may come as soon as this line is out
            time.sleep(600)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            raise SystemExit(130)
    """, "--nproc-per-node", "2")
    ready = 0
    while ready < 2:
        line = process.stdout.readline()
        assert line, "launcher ended early"
        ready += "ready" in line
    process.send_signal(signal.SIGINT)
    code, out, err = finish(process)
    assert out.count("interrupted") == 2, (out, err)
    assert code == 130 and "got SIGINT; forwarding it to every worker" in err


def test_grandchildren_are_stopped_too(tmp_path):
    process = distkeras_launch(tmp_path, """
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(child.pid, flush=True)
        if os.environ["RANK"] == "1":
            time.sleep(1)
            sys.exit(1)
        time.sleep(600)
    """, "--nproc-per-node", "2", "--stop-timeout", "5")
    code, out, _ = finish(process)
    pids = [int(line.split("] ")[1]) for line in out.splitlines()]
    time.sleep(0.5)
    assert code == 1 and len(pids) == 2 and not any(alive(pid) for pid in pids)


@pytest.mark.parametrize("coordinator", ["127.0.0.1", "127.0.0.1:notaport", ":29500", "host:70000", ""])
def test_malformed_coordinator(tmp_path, coordinator):
    process = distkeras_launch(tmp_path, "print('never')\n", "--nproc-per-node", "2", "--coordinator", coordinator)
    code, out, err = finish(process)
    assert code == 2 and "never" not in out
    assert "Expected --coordinator HOST:PORT" in err and "Received: --coordinator={!r}".format(coordinator) in err


def test_coordinator_port_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        process = distkeras_launch(tmp_path, "print('never')\n", "--nproc-per-node", "2", "--coordinator",
                                   "127.0.0.1:{}".format(port))
        code, out, err = finish(process)
    assert code == 2 and "never" not in out
    assert "127.0.0.1:{} can't be used on this host".format(port) in err and "Pick another port" in err


def test_plan_is_pure_and_checks_its_arguments():
    hosts = ["10.1.2.3", "10.1.2.4"]
    commands, envs, ranks = launch.plan(["train.py", "--x"], 2, nnodes=2, node_rank=1, coordinator="10.1.2.3:29500",
                                        backend="torch", python="py", environ={}, addresses=hosts, interface="eth1")
    assert commands == [["py", "train.py", "--x"]] * 2 and ranks == [2, 3]
    assert envs[1]["RANK"] == "3" and envs[1]["LOCAL_RANK"] == "1" and envs[1]["WORLD_SIZE"] == "4"
    # Across hosts the launchers meet at PORT; the engine's rendezvous is PORT+1.
    assert envs[0]["MASTER_ADDR"] == "10.1.2.3" and envs[0]["MASTER_PORT"] == "29501" and "TF_CONFIG" not in envs[0]
    assert envs[0]["JAX_COORDINATOR_ADDRESS"] == "10.1.2.3:29501"
    assert envs[0]["DISTKERAS_INTERFACE"] == "eth1" and envs[0]["DISTKERAS_LAUNCHER_PID"] == str(os.getpid())
    # A user's own choice of interface is kept.
    _, kept, _ = launch.plan(["t.py"], 1, nnodes=2, node_rank=1, coordinator="10.1.2.3:29500", backend="torch",
                             environ={"DISTKERAS_INTERFACE": "eth7"}, addresses=hosts, interface="eth1")
    assert kept[0]["DISTKERAS_INTERFACE"] == "eth7"
    _, envs, _ = launch.plan(["t.py"], 2, nnodes=2, node_rank=1, coordinator="10.1.2.3:29500", backend="tensorflow",
                             tf_hosts=hosts, environ={})
    assert json.loads(envs[0]["TF_CONFIG"]) == {
        "cluster": {"worker": ["10.1.2.3:29501", "10.1.2.3:29502", "10.1.2.4:29501", "10.1.2.4:29502"]},
        "task": {"type": "worker", "index": 2}}
    # One host: the coordinator is the engine's rendezvous itself.
    _, single, _ = launch.plan(["t.py"], 2, coordinator="127.0.0.1:29600", backend="torch", environ={})
    assert single[0]["MASTER_PORT"] == "29600" and "DISTKERAS_INTERFACE" not in single[0]
    with pytest.raises(LaunchError, match="needs --coordinator"):
        launch.plan(["t.py"], 2, nnodes=2, node_rank=0, backend="torch")
    with pytest.raises(LaunchError, match="needs every host's address"):
        launch.plan(["t.py"], 2, nnodes=2, node_rank=1, coordinator="h:1", backend="tensorflow")
    with pytest.raises(LaunchError, match="--node-rank"):
        launch.plan(["t.py"], 2, nnodes=2, node_rank=2, coordinator="h:1", backend="torch")
    with pytest.raises(LaunchError, match="--nproc-per-node >= 1"):
        launch.plan(["t.py"], 0)
    with pytest.raises(LaunchError, match="Expected a script"):
        launch.plan([], 2)


def test_a_module_gets_its_own_options(tmp_path):
    """`-m pkg.module --flag value`: the options after the module are the module's, as with python -m."""
    (tmp_path / "shout.py").write_text("import sys\nprint(sys.argv[1:])\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, str(tmp_path)]), KERAS_HOME=str(tmp_path))
    env.pop("KERAS_BACKEND", None)
    command = [sys.executable, "-m", "distkeras", "launch", "--nproc-per-node", "2", "--backend", "tensorflow",
               "-m", "shout", "--workload", "x", "-v"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[rank 0] ['--workload', 'x', '-v']", "[rank 1] ['--workload', 'x', '-v']"]


def test_a_module_flag_without_a_module_is_an_error(tmp_path):
    env = dict(os.environ, PYTHONPATH=SRC, KERAS_HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "distkeras", "launch", "--nproc-per-node", "2", "-m"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert done.returncode == 2 and "-m needs a module" in done.stderr


def test_a_failed_worker_exits_although_an_exit_handler_would_wait_forever(tmp_path):
    """A worker of a job that raises ends within api.EXIT_GRACE seconds even when an engine's exit handler
    (jax.distributed's shutdown barrier, a process group waiting on its peers) would block: its launcher
    must see it fail."""
    from distkeras import api

    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent("""
        import atexit, threading
        import distkeras
        atexit.register(threading.Event().wait)   # an exit handler that never returns
        raise RuntimeError("the worker failed")
    """))
    env = dict(os.environ, PYTHONPATH=SRC, KERAS_BACKEND="tensorflow", RANK="1", WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="1", KERAS_HOME=str(tmp_path))
    started = time.time()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=api.EXIT_GRACE + 30)
    elapsed = time.time() - started
    assert done.returncode == 1 and "RuntimeError: the worker failed" in done.stderr
    assert elapsed < api.EXIT_GRACE + 5
    # One process without a job keeps Python's own behaviour (nothing is installed).
    env = dict(env, RANK="0", WORLD_SIZE="1")
    script.write_text("import distkeras, sys\nprint(sys.excepthook is sys.__excepthook__)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert done.stdout.strip() == "True", done.stderr


def test_a_preempted_worker_lets_the_others_finish_their_step_and_the_launcher_exits_75(tmp_path):
    """Exit status 75 (launch.EXIT_PREEMPTED) is a preemption, not a crash: the others stop after the same step
    on their own, so they are given --stop-timeout seconds (not a SIGTERM at once), and the job exits 75."""
    process = distkeras_launch(tmp_path, """
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: print("sigterm", flush=True))
        time.sleep(0.5 + 2 * int(os.environ["RANK"]))  # rank 1 still writes its part when rank 0 is gone
        print("saved", flush=True)
        sys.exit(75)
    """, "--nproc-per-node", "2", "--stop-timeout", "10")
    code, out, err = finish(process)
    assert code == launch.EXIT_PREEMPTED, (out, err)
    assert out.count("saved") == 2 and "sigterm" not in out, (out, err)
    assert "rank 0 was preempted (exit code 75)" in err and "died" not in err
    assert "job preempted: exiting with status 75; run the same command again to resume" in err


def test_a_sigterm_to_the_launcher_reaches_every_worker_and_their_75_is_the_jobs(tmp_path):
    """Slurm's preemption (or `scancel --signal=TERM`) signals the launcher: it forwards SIGTERM, the workers
    checkpoint and exit 75, and the launcher exits 75 too, not as a crash (143)."""
    process = distkeras_launch(tmp_path, """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
        print("ready", flush=True)
        time.sleep(600)
    """, "--nproc-per-node", "2", "--stop-timeout", "10")
    ready = 0
    while ready < 2:
        line = process.stdout.readline()
        assert line, "launcher ended early"
        ready += "ready" in line
    process.send_signal(signal.SIGTERM)
    code, out, err = finish(process)
    assert code == launch.EXIT_PREEMPTED, (out, err)
    assert "got SIGTERM; forwarding it to every worker" in err and "died" not in err
    assert "job preempted: exiting with status 75" in err
