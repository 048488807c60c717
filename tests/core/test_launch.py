"""`distkeras launch` with plain-Python workers (no framework): env, output, failures, signals, bad input.
Everything binds to 127.0.0.1, runs under a hard timeout, and leaves no process behind."""

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from distkeras import LaunchError
from distkeras.launch import command as launch, processes

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")


def distkeras_launch(tmp_path, worker_body, *launch_args, timeout=60, env_extra=None, **popen):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(worker_body))
    env = dict(os.environ, PYTHONPATH=SRC, KERAS_HOME=str(tmp_path), **(env_extra or {}))
    env.pop("KERAS_BACKEND", None)
    command = [sys.executable, "-m", "distkeras", "launch", *launch_args, str(script)]
    popen = dict(dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE), **popen)
    return subprocess.Popen(command, text=True, env=env, cwd=tmp_path, **popen)


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
    lines = sorted(line for line in out.splitlines() if not line.endswith("] warning on stderr"))
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
    # A worker's stderr shares its one pipe with its stdout: on the launcher's stdout, after the line printed before.
    for rank in range(3):
        mine = [line for line in out.splitlines() if line.startswith("[rank {}] ".format(rank))]
        assert len(mine) == 2 and mine[1] == "[rank {}] warning on stderr".format(rank), out
    assert "[rank" not in err


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
    # A SIGKILL nobody announced is named as what it often is (here no OOM kill was counted: the hint alone).
    assert "rank 1 died (SIGKILL: often the kernel's out-of-memory killer; check `dmesg`" in err
    assert elapsed < 20
    pids = [int(line.split("] ")[1]) for line in out.splitlines()]
    assert len(pids) == 3 and not any(alive(pid) for pid in pids)


def test_a_sigkill_is_named_the_out_of_memory_killers_where_the_cgroup_counted_one(tmp_path):
    assert processes.memory_hint(-signal.SIGKILL, 3, 4) == (
        "(SIGKILL: likely the kernel's out-of-memory killer: this job's cgroup counted 1 OOM kill since the launch, "
        "oom_kill 3 -> 4; give the job more memory, or make the model or the per-device batch smaller)")
    hint = "(SIGKILL: often the kernel's out-of-memory killer; check `dmesg` / the job's memory limit)"
    assert processes.memory_hint(-signal.SIGKILL, 4, 4) == processes.memory_hint(-signal.SIGKILL) == hint
    assert processes.memory_hint(-signal.SIGKILL, None, 2) == hint
    assert processes.memory_hint(-signal.SIGTERM, 0, 5) is None and processes.memory_hint(1, 0, 5) is None
    assert processes.describe_exit(-signal.SIGKILL) == "killed by SIGKILL" and processes.describe_exit(3) == "exit code 3"
    # The counters: cgroup v2's memory.events (also under a hybrid mount's unified/), else v1's memory.oom_control.
    (tmp_path / "job.slice").mkdir()
    (tmp_path / "job.slice" / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\n")
    (tmp_path / "v2").write_text("0::/job.slice\n")
    assert processes.oom_counter_file(str(tmp_path / "v2"), str(tmp_path)) == str(tmp_path / "job.slice" / "memory.events")
    assert processes.oom_kills(str(tmp_path / "job.slice" / "memory.events")) == 2
    (tmp_path / "memory" / "docker" / "c1").mkdir(parents=True)
    (tmp_path / "memory" / "docker" / "c1" / "memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    (tmp_path / "memory" / "docker" / "c1" / "worker1").mkdir()  # v1 counts a group's own kills: its subgroups add up
    (tmp_path / "memory" / "docker" / "c1" / "worker1" / "memory.oom_control").write_text("oom_kill 1\n")
    (tmp_path / "v1").write_text("4:memory:/docker/c1\n1:cpu:/docker/c1\n0::/\n")
    found = processes.oom_counter_file(str(tmp_path / "v1"), str(tmp_path))
    assert found == str(tmp_path / "memory" / "docker" / "c1" / "memory.oom_control") and processes.oom_kills(found) == 6
    (tmp_path / "none").write_text("1:cpu:/\n")
    assert processes.oom_counter_file(str(tmp_path / "none"), str(tmp_path)) is None
    assert processes.oom_counter_file(str(tmp_path / "absent"), str(tmp_path)) is None


def test_a_launcher_names_a_worker_the_oom_killer_ended(monkeypatch):
    kills = iter([0, 1])
    monkeypatch.setattr(launch, "_OOM_KILLS_AT_START", next(kills))
    monkeypatch.setattr(processes, "oom_kills", lambda events=None: next(kills))
    out, err = io.StringIO(), io.StringIO()
    die = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    code = launch.Launcher([die], [dict(os.environ)], [0], stop_timeout=5, stdout=out, stderr=err).run()
    assert code == 128 + 9
    assert "rank 0 died (killed by SIGKILL); stopping" in err.getvalue()
    assert "rank 0 died (SIGKILL: likely the kernel's out-of-memory killer: this job's cgroup counted 1 OOM kill" \
           in err.getvalue(), err.getvalue()


def test_a_worker_over_its_memory_cap_is_named_the_oom_killers(tmp_path):
    """The real thing: rank 1 joins a cgroup capped at 64 MiB under the launcher's own and allocates 512 MiB."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import cgroups

    reason = cgroups.unavailable()
    if reason:
        print("skipped: " + reason)
        pytest.skip(reason)
    with cgroups.MemoryCaps(1, 64 * 2 ** 20) as caps:
        process = distkeras_launch(tmp_path, """
            import os, sys, time
            sys.path.insert(0, {!r})
            import cgroups
            if os.environ["RANK"] == "1":
                cgroups.join_from_env(0)
                block = bytearray(512 * 2 ** 20)
            time.sleep(600)
        """.format(os.path.dirname(os.path.abspath(cgroups.__file__))), "--nproc-per-node", "2", "--stop-timeout", "5",
            env_extra=caps.environment())
        code, _, err = finish(process)
        assert caps.stats(0)["oom_kills"] >= 1
    assert code == 128 + 9, err
    assert "rank 1 died (SIGKILL: likely the kernel's out-of-memory killer" in err, err


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
    assert "Port {} on this host (127.0.0.1), --coordinator's PORT".format(port) in err and "can't be used" in err
    assert "ss -ltnp 'sport = :{}'".format(port) in err


def test_a_busy_engine_port_is_named_as_the_port_after_the_launchers():
    """Across hosts the launchers meet at --coordinator's PORT and the engines at PORT+1 ...: a busy PORT+1 was
    called "the coordinator address"."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(LaunchError) as info:
            launch.check_port_free("127.0.0.1", port, coordinator_port=port - 1)
        assert "Port {} on this host (127.0.0.1), PORT+1 after --coordinator's PORT {} (the launchers' own)".format(
            port, port - 1) in str(info.value)
        assert "coordinator address" not in str(info.value) and "PORT+1 for the engine's rendezvous" in str(info.value)
        with pytest.raises(LaunchError, match="--coordinator's PORT .where the launchers meet"):
            launch.check_port_free("127.0.0.1", port, coordinator_port=port)
        with pytest.raises(LaunchError, match=r"binds --coordinator's PORT .* the ports after it: PORT\+1"):
            launch.check_port_free("127.0.0.1", port)


def test_a_command_that_is_nowhere_is_refused_before_any_worker_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LaunchError) as info:
        launch.plan(["nosuchcommand", "--x"], 2)
    message = str(info.value)
    assert "Received: 'nosuchcommand', which is neither a program on PATH nor a file (in {})".format(tmp_path) in message
    assert "give its full path, or add its folder to PATH" in message
    with pytest.raises(LaunchError, match="neither a program on PATH nor a file"):
        launch.check_counts([str(tmp_path / "absent" / "prog")], 1, 1, 0)
    (tmp_path / "notes").write_text("hello\n")
    with pytest.raises(LaunchError, match=r"'notes', a file that is not executable. Make it executable \(chmod \+x"):
        launch.check_counts(["notes"], 1, 1, 0)
    (tmp_path / "prog").write_text("#!/bin/sh\necho hi\n")
    (tmp_path / "prog").chmod(0o755)
    with pytest.raises(LaunchError, match="run it as ./prog"):
        launch.check_counts(["prog"], 1, 1, 0)
    launch.check_counts(["./prog"], 1, 1, 0)
    launch.check_counts(["true"], 1, 1, 0)
    launch.check_counts(["absent.py"], 1, 1, 0)  # plan() reads nothing but PATH; the command checks the script:
    with pytest.raises(LaunchError, match="Can't find the script 'absent.py' in .*, so no worker was started"):
        launch.check_script(["absent.py"])
    launch.check_script(["-m", "absent"])
    # From the command line: a clear error, exit status 2, and no worker started.
    env = dict(os.environ, PYTHONPATH=SRC, KERAS_HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "distkeras", "launch", "--nproc-per-node", "2", "nosuchcommand"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert done.returncode == 2 and "FileNotFoundError" not in done.stderr and "[rank" not in done.stderr
    assert "'nosuchcommand', which is neither a program on PATH nor a file" in done.stderr, done.stderr


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
    """A worker of a job that raises ends within worker.EXIT_GRACE seconds even when an engine's exit handler
    (jax.distributed's shutdown barrier, a process group waiting on its peers) would block: its launcher
    must see it fail."""
    from distkeras import worker

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
                          timeout=worker.EXIT_GRACE + 30)
    elapsed = time.time() - started
    assert done.returncode == 1 and "RuntimeError: the worker failed" in done.stderr
    assert elapsed < worker.EXIT_GRACE + 5
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


# ---- output people can read: progress bars, order, --log-dir, --ranks

#: A worker as Keras' progress bar writes: "\b"s and a "\r" before each update, colour codes, the line's end last;
#: a warning on stderr while the bar is mid-row; stderr lines between its stdout lines.
PROGRESS = """
    import os, sys, time
    print("before")
    for step in range(1, 4):
        sys.stdout.write("\\b" * 12 + "\\r\\x1b[1mstep %d/3\\x1b[0m" % step)
        sys.stdout.flush()
        time.sleep(0.15)
        if step == 2:
            print("a warning mid-bar", file=sys.stderr)
    sys.stdout.write("\\n")
    for i in range(5):
        print("out", i)
        print("err", i, file=sys.stderr)
    print("after")
"""
PROGRESS_LINES = (["before", "step 2/3", "a warning mid-bar", "step 3/3"] + [line for i in range(5) for line in ("out {}".format(i), "err {}".format(i))]
                  + ["after"])


def on_terminal(tmp_path, worker_body, *launch_args, timeout=60):
    """``distkeras launch`` with a terminal (a pty, 100 columns) as its stdout: (exit code, what the terminal got,
    stderr)."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    try:
        process = distkeras_launch(tmp_path, worker_body, *launch_args, stdout=slave)
    finally:
        os.close(slave)
    got, deadline = b"", time.time() + timeout
    try:
        while time.time() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every writer of the pty is gone
                    break
                if not data:
                    break
                got += data
            elif process.poll() is not None:
                break
        code, _, err = finish(process, timeout=max(1, deadline - time.time()))
    finally:
        os.close(master)
    return code, got.decode("utf-8").replace("\r\n", "\n"), err  # the pty's line discipline writes "\n" as "\r\n"


def screen(raw):
    """The rows a terminal shows after ``raw``: "\\r" back to the row's start, text overwrites, ESC[K clears the rest
    of the row, colour codes take no room."""
    rows, row, column = [], [], 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\r|\n|[^\x1b\r\n]", raw):
        if token == "\r":
            column = 0
        elif token == "\n":
            rows.append("".join(row))
            row, column = [], 0
        elif token == "\x1b[K":
            del row[column:]
        elif not token.startswith("\x1b"):
            row[column:column + 1] = [token]
            column += 1
    return rows + (["".join(row)] if row else [])


def of_rank(out, rank):
    prefix = "[rank {}] ".format(rank)
    return [line[len(prefix):] for line in out.splitlines() if line.startswith(prefix)]


def test_in_a_pipe_progress_updates_collapse_to_the_final_line_and_stderr_keeps_its_place(tmp_path):
    code, out, err = finish(distkeras_launch(tmp_path, PROGRESS, "--nproc-per-node", "2"))
    assert code == 0, err
    for rank in (0, 1):
        assert of_rank(out, rank) == PROGRESS_LINES, out
    assert "\r" not in out and "\b" not in out and "\x1b" not in out  # no partial lines, no colour codes
    assert len(out.splitlines()) == 2 * len(PROGRESS_LINES)


def test_on_a_terminal_progress_updates_are_rewritten_in_place_in_colour(tmp_path):
    code, raw, err = on_terminal(tmp_path, PROGRESS, "--nproc-per-node", "2", "--ranks", "0")
    assert code == 0, err
    assert screen(raw) == ["[rank 0] " + line for line in PROGRESS_LINES], repr(raw)
    # Each update went out as it came, on the bar's row: "\r", the prefix, the latest state; never a row of its own.
    updates = [raw.index("\r[rank 0] \x1b[1mstep {}/3\x1b[0m".format(step)) for step in (1, 2, 3)]
    assert updates == sorted(updates) and "\n" not in raw[updates[0]:updates[1]], repr(raw)
    assert "\x1b[1mstep 3/3\x1b[0m\n" in raw  # colour codes kept on a terminal


@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "terminal"])
def test_lines_of_different_ranks_never_mix(tmp_path, terminal):
    """Three ranks write long lines in small pieces at once; each line comes out whole, under its rank, in order."""
    body = """
        import os, sys, time
        rank = os.environ["RANK"]
        for i in range(15):
            line = "line {} of rank {} ".format(i, rank) + rank * 60 + "\\n"
            for start in range(0, len(line), 7):
                sys.stdout.write(line[start:start + 7])
                sys.stdout.flush()
                time.sleep(0.001)
    """
    if terminal:
        code, raw, err = on_terminal(tmp_path, body, "--nproc-per-node", "3")
        rows = screen(raw)
    else:
        code, out, err = finish(distkeras_launch(tmp_path, body, "--nproc-per-node", "3"))
        rows = out.splitlines()
    assert code == 0, err
    assert len(rows) == 45, rows
    for rank in range(3):
        expected = ["line {} of rank {} ".format(i, rank) + str(rank) * 60 for i in range(15)]
        assert of_rank("\n".join(rows), rank) == expected, rows


def test_log_dir_keeps_each_ranks_whole_output_and_ranks_picks_what_the_console_shows(tmp_path):
    logs = tmp_path / "logs" / "run1"  # made, parents too
    code, out, err = finish(distkeras_launch(tmp_path, PROGRESS, "--nproc-per-node", "3", "--ranks", "0,2",
                                             "--log-dir", str(logs)))
    assert code == 0, err
    assert of_rank(out, 0) == of_rank(out, 2) == PROGRESS_LINES and of_rank(out, 1) == []
    assert len(out.splitlines()) == 2 * len(PROGRESS_LINES)
    assert sorted(os.listdir(logs)) == ["rank0.log", "rank1.log", "rank2.log"]
    for rank in range(3):  # no prefix, no partial lines, no colour codes: what a pipe shows
        assert (logs / "rank{}.log".format(rank)).read_text() == "".join(line + "\n" for line in PROGRESS_LINES)


def test_log_dir_writes_through_no_planted_link_and_a_folder_in_a_logs_place_is_refused_before_any_start(tmp_path):
    """Issue 46: a link planted at rank0.log made the launcher write the log into the file it points to."""
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file")
    logs = tmp_path / "logs"
    logs.mkdir()
    os.symlink(str(victim), str(logs / "rank0.log"))
    (logs / "rank1.log").write_text("the previous run's log\n")
    code, out, err = finish(distkeras_launch(tmp_path, PROGRESS, "--nproc-per-node", "2", "--log-dir", str(logs)))
    assert code == 0, err
    assert victim.read_text() == "the user's file" and not (logs / "rank0.log").is_symlink()
    for rank in range(2):
        assert (logs / "rank{}.log".format(rank)).read_text() == "".join(line + "\n" for line in PROGRESS_LINES)
    (logs / "rank0.log").unlink()
    (logs / "rank0.log").mkdir()
    code, out, err = finish(distkeras_launch(tmp_path, "print('started')", "--nproc-per-node", "2",
                                             "--log-dir", str(logs)))
    assert code == 2 and "started" not in out and "Can't replace the log file {}".format(logs / "rank0.log") in err


def test_a_failing_rank_that_ranks_hides_has_its_last_lines_shown(tmp_path):
    code, out, err = finish(distkeras_launch(tmp_path, """
        import os, time
        if os.environ["RANK"] == "1":
            print("rank 1 was here")
            raise RuntimeError("rank 1 fails")
        time.sleep(600)
    """, "--nproc-per-node", "2", "--ranks", "0", "--stop-timeout", "5"))
    assert code == 1
    assert "rank 1 died (exit code 1)" in err and "rank 1's output isn't shown (--ranks); its last" in err, err
    assert "[rank 1] rank 1 was here" in out and "[rank 1] RuntimeError: rank 1 fails" in out, out


@pytest.mark.parametrize("ranks", ["2", "0,x", "-1", ""])
def test_ranks_of_no_worker_are_refused_before_any_starts(tmp_path, ranks):
    code, out, err = finish(distkeras_launch(tmp_path, "print('started')", "--nproc-per-node", "2", "--ranks", ranks))
    assert code == 2 and "started" not in out
    assert "Expected --ranks to list ranks of the job, comma-separated, each 0..1" in err, err
    assert launch.parse_ranks("1, 0,1", 2) == [0, 1] and launch.parse_ranks(None, 2) is None
