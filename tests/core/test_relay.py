"""The relay of worker output (distkeras.launch.relay), piece by piece: lines as a terminal ends up showing them, the
console's rows, a relay's log and tail. Real processes: tests/core/test_launch.py."""

import io
import os
import subprocess
import sys

import pytest

from distkeras.launch import relay

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")


def test_lines_keep_what_a_terminal_ends_up_showing():
    lines = relay.Lines()
    assert lines.feed(b"Epoch 1/2\n  1/71 \x1b[1m\xe2\x94") == ["Epoch 1/2"]  # a UTF-8 character cut in two
    assert lines.current == "  1/71 \x1b[1m" and not lines.rewritten
    assert lines.feed(b"\x81\b\b\b\b\r 71/71 \xe2\x94\x81 done") == []  # Keras: a row of "\b", then "\r"
    assert lines.current == " 71/71 \u2501 done" and lines.rewritten
    assert lines.feed(b"\n") == [" 71/71 \u2501 done"] and lines.current == "" and not lines.rewritten
    assert lines.feed(b"windows\r\n") == ["windows"]  # "\r\n" ends the line, it doesn't empty it
    assert lines.feed(b"spin |\b/\b-\bok\n") == ["spin ok"]  # "\b" and text: the text takes the place
    assert lines.feed(b"\r\r\n") == [""]
    assert lines.feed(b"no end, bad byte \xff") == [] and lines.feed(b"", final=True) == ["no end, bad byte \ufffd"]


def test_a_bar_left_unfinished_and_continued_later_without_a_return_ends_before_the_continuation():
    """rank 0's stderr and stdout share a pipe: a warning written while Keras' bar is mid-row gets a row of its own."""
    lines = relay.Lines()
    assert lines.feed(b"\r 1/9 bar", now=10.0) == []
    assert lines.feed(b"\b\b\r 2/9 bar", now=10.5) == [] and lines.current == " 2/9 bar"  # an update: "\b", "\r"
    assert lines.feed(b"distkeras: preempted\n", now=11.0) == [" 2/9 bar", "distkeras: preempted"]
    assert lines.feed(b"\r 3/9", now=12.0) == [] and lines.feed(b" bar\n", now=12.0) == [" 3/9 bar"]  # one print()
    assert lines.feed(b"\r 4/9", now=13.0) == [] and lines.feed(b"\x1b[0m\n", now=14.0) == [" 4/9\x1b[0m"]
    assert lines.feed(b"no bar", now=15.0) == [] and lines.feed(b" continued\n", now=16.0) == ["no bar continued"]


def test_escape_sequences_are_stripped_and_a_long_row_is_cut_by_what_shows():
    assert relay.strip_escapes("\x1b[1m3/71\x1b[0m \x1b[32m\u2501\x1b[0m\x1b[K \x1b]0;title\x07x") == "3/71 \u2501 x"
    coloured = "\x1b[1m12345\x1b[0m67890"
    assert relay._fit(coloured, 20) == coloured and relay._fit("abcdef", None) == "abcdef"
    assert relay._fit(coloured, 7) == "\x1b[1m12345\x1b[0m67\x1b[0m"
    assert relay._fit(coloured, 3) == "\x1b[1m123\x1b[0m" and relay._fit("abcdef", 4) == "abcd"


def test_a_console_that_is_no_terminal_writes_finished_lines_without_colour():
    out = io.StringIO()
    console = relay.Console(out)
    assert not console.terminal and not console.in_place
    console.update("rank 0", "[rank 0] ", "half a bar")
    console.lines("rank 0", "[rank 0] ", ["\x1b[1mdone\x1b[0m", ""])
    err = io.StringIO()
    console.message(err, "distkeras launch: hello\n")
    assert out.getvalue() == "[rank 0] done\n[rank 0] \n" and err.getvalue() == "distkeras launch: hello\n"


def test_a_terminal_console_keeps_one_unfinished_line_in_place_below_the_others():
    out = io.StringIO()
    console = relay.Console(out, terminal=True)
    console.update("rank 0", "[rank 0] ", "\x1b[1m1/3\x1b[0m")
    console.update("rank 0", "[rank 0] ", "\x1b[1m1/3\x1b[0m")  # the same: nothing written
    console.update("rank 0", "[rank 0] ", "\x1b[1m2/3\x1b[0m")
    console.lines("rank 1", "[rank 1] ", ["hello"])  # clears the bar's row, writes, draws the bar again
    console.message(out, "distkeras launch: news\n")
    console.lines("rank 0", "[rank 0] ", ["\x1b[1m3/3\x1b[0m"])  # the bar's last state replaces it, and ends it
    assert out.getvalue() == (
        "\r[rank 0] \x1b[1m1/3\x1b[0m\x1b[K"
        "\r[rank 0] \x1b[1m2/3\x1b[0m\x1b[K"
        "\r\x1b[K[rank 1] hello\n[rank 0] \x1b[1m2/3\x1b[0m\x1b[K"
        "\r\x1b[Kdistkeras launch: news\n[rank 0] \x1b[1m2/3\x1b[0m\x1b[K"
        "\r\x1b[K[rank 0] \x1b[1m3/3\x1b[0m\n")
    shared = io.StringIO()  # another writer's progress bar may be on the row: cleared first, nothing in place
    console = relay.Console(shared, terminal=True, shared=True)
    console.update("rank 1", "[rank 1] ", "half")
    console.lines("rank 1", "[rank 1] ", ["whole"])
    assert shared.getvalue() == "\r\x1b[K[rank 1] whole\n"


def test_a_relay_logs_every_line_and_keeps_the_last_of_a_hidden_process(tmp_path):
    out = io.StringIO()
    console = relay.Console(out)
    log = open(str(tmp_path / "rank1.log"), "w")
    hidden = relay.Relay(console, "rank 1", shown=False, log=log)
    worker = subprocess.Popen([sys.executable, "-c", "import sys\nfor i in range(30): print(i, file=sys.stderr if i % 2 "
                               "else sys.stdout)\nsys.stdout.write('\\x1b[1mlast\\x1b[0m\\rlast, no end')"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0)
    hidden.start(worker.stdout)
    hidden.join(30)
    worker.wait(30)
    assert out.getvalue() == "" and log.closed
    whole = [str(i) for i in range(30)] + ["last, no end"]
    assert (tmp_path / "rank1.log").read_text() == "".join(line + "\n" for line in whole)
    assert list(hidden.tail) == whole[-relay.TAIL:]


def test_a_relay_whose_console_fails_still_drains_the_pipe():
    """`distkeras launch ... | head`: once the console can't be written, the worker must not block on a full pipe."""
    read, write = os.pipe()
    closed = io.StringIO()
    closed.close()
    gone = relay.Relay(relay.Console(closed), "rank 0")
    gone.start(os.fdopen(read, "rb", buffering=0))
    with os.fdopen(write, "wb") as pipe:
        pipe.write(b"x" * 100 + b"\n" * 200000)  # more than a pipe holds: blocks unless it is read
    gone.join(30)
    assert not gone.thread.is_alive()


@pytest.mark.parametrize("unbuffered", ["1", ""], ids=["unbuffered", "buffered"])
def test_a_relay_in_a_process_that_prints_writes_between_its_prints(unbuffered):
    """PyTorch's self-launch: rank 0 prints while its relay writes rank 1's lines. print() writes its arguments and
    its "\\n" one by one, each straight to the file when unbuffered (python -u, PYTHONUNBUFFERED): the relay's lines
    must still land whole between rank 0's, and in a buffered process (no flush) in order with what it buffered."""
    code = """if True:
        import subprocess, sys
        from distkeras.launch import relay
        child = subprocess.Popen([sys.executable, "-c", "for i in range(2000): print('child', i, 'x' * 40)"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0)
        relayed = relay.Relay(relay.Console(relay.SharedStream.install(), shared=True), "rank 1")
        relayed.start(child.stdout)
        for i in range(2000):
            print("parent", i, "y" * 40)
        child.wait()
        relayed.join(30)
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line for line in lines if line.startswith("parent")] == ["parent {} {}".format(i, "y" * 40) for i in range(2000)]
    assert [line for line in lines if not line.startswith("parent")] == [
        "[rank 1] child {} {}".format(i, "x" * 40) for i in range(2000)]


def test_a_shared_stream_waits_for_the_line_only_so_long():
    """A progress bar's update or a prompt leaves rank 0's line open: the relay's line waits PAUSE, not for ever."""
    out = io.StringIO()
    shared = relay.SharedStream(out)
    shared.own.write("Continue? ")
    shared.write("[rank 1] hello\n")
    assert out.getvalue() == "Continue? [rank 1] hello\n"
    assert shared.own.isatty() is False and shared.own.getvalue() == out.getvalue()  # the rest is the stream's
