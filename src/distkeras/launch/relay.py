"""Worker output, relayed: every line whole, under its process' prefix (``[rank 1] ``), in the order the worker
wrote it; a progress bar's ``\\r`` updates shown in place on a terminal and collapsed to each line's final state
anywhere else (a pipe, a log file), where colour codes are dropped too.

Used by ``distkeras launch`` (:mod:`distkeras.launch`) and by PyTorch's self-launch (the processes a plain
``python script.py`` starts), where rank 0 prints too and shares its ``sys.stdout`` with the relay
(:class:`SharedStream`). Part of the Python 3.6-compatible core: standard library only.

    console = Console(sys.stdout)                       # a terminal? in place : collapsed, no colour codes
    relay = Relay(console, "rank 1", log=open("rank1.log", "w"))
    relay.start(process.stdout)                         # a thread reads the pipe in chunks until its end
"""

import codecs
import collections
import os
import re
import select
import sys
import threading
import time
from typing import List, Optional

#: ANSI escape sequences: CSI (colours, cursor moves, ``ESC[K``), OSC (window titles, links), and the two-character
#: ones. Keras' progress bar colours its counts and its bar with CSI sequences.
_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
_CONTROL = re.compile(r"([\r\n\b])")
#: Clears the terminal's row from the cursor to its end.
_CLEAR = "\x1b[K"
_RESET = "\x1b[0m"
#: Bytes read from a process' pipe at a time: whatever is there, up to this.
_CHUNK = 65536
#: Lines kept of a process whose output isn't shown, for the report of its failure.
TAIL = 20
#: Seconds after which text continuing a progress bar's row without a ``\r`` is taken for another line (:class:`Lines`).
PAUSE = 0.02
#: Seconds a line still being written (``print(..., end="")``, a prompt) waits for its end before a terminal shows
#: it unfinished: a print() of several arguments writes each separately, and would flicker. A progress bar's
#: update (after a ``\r``) shows at once.
SETTLE = 0.1


def strip_escapes(text: str) -> str:
    """``text`` without ANSI escape sequences (colours, cursor moves).

    Examples:
        >>> strip_escapes("\\x1b[1m3/71\\x1b[0m \\x1b[32m━━\\x1b[0m")
        '3/71 ━━'
    """
    return _ESCAPE.sub("", text)


def is_terminal(stream: object) -> bool:
    """Whether ``stream`` is a terminal (a file object whose ``isatty()`` says so)."""
    try:
        return bool(stream.isatty())  # type: ignore
    except (AttributeError, ValueError, OSError):  # no isatty, or closed
        return False


class FdStream(object):
    """A text stream straight onto a file descriptor (``os.write``, UTF-8): where a process has no ``sys.stdout``
    (``pythonw``, a closed stream) to share with its relay (:class:`SharedStream`)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.encoding = "utf-8"

    def write(self, text: str) -> None:
        data = text.encode("utf-8", "replace")
        while data:
            data = data[os.write(self.fd, data):]

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        return self.fd

    def isatty(self) -> bool:
        return os.isatty(self.fd)


#: Seconds at most a relay's lines wait for the end of the line its own process is writing (:class:`SharedStream`).
WAIT = 1.0


class SharedStream(object):
    """A process' own text stream (its ``sys.stdout``) that a relay in the same process writes to as well: the
    relay's lines go between the process' lines, never inside one.

    ``print()`` writes its arguments, their separators and its ``"\\n"`` one by one; unbuffered (``python -u``,
    ``PYTHONUNBUFFERED``, as ``distkeras launch`` and many containers run Python) each piece reaches the file at once,
    so a line written beneath the process' stream at any moment could land inside a ``print()``. So the process
    writes through :attr:`own` (put in place of ``sys.stdout`` by :meth:`install`), and the relay's :meth:`write`
    waits until the process' last write ended its line, or wrote nothing for :data:`PAUSE` seconds (a progress bar's
    update, a prompt: the line stays open), or :data:`WAIT` seconds passed; then it writes through the same stream,
    in order with the process' own buffered text.

    Examples:
        >>> import io
        >>> out = io.StringIO()
        >>> shared = SharedStream(out)
        >>> shared.own.write("rank 0 says")
        11
        >>> shared.own.write("\\n"); shared.write("[rank 1] hello\\n")
        1
        >>> out.getvalue()
        'rank 0 says\\n[rank 1] hello\\n'
    """

    def __init__(self, stream: object) -> None:
        self.stream = stream
        self.encoding = getattr(stream, "encoding", None)
        self._turn = threading.Condition()  # reentrant: a signal handler in the middle of a write may print too
        self._open = False  # the process' last write left its line unfinished
        self._when = 0.0  # when it wrote last
        self.own = _Own(self)

    @classmethod
    def install(cls) -> object:
        """Share this process' ``sys.stdout`` with a relay: returns the stream the relay's console writes to (an
        :class:`FdStream` onto file descriptor 1 where there is no ``sys.stdout``)."""
        if sys.stdout is None:
            return FdStream(1)
        if isinstance(sys.stdout, _Own):
            return sys.stdout.shared
        shared = cls(sys.stdout)
        sys.stdout = shared.own
        return shared

    def _own_write(self, text: str) -> int:
        with self._turn:
            written = self.stream.write(text)  # type: ignore
            if text:
                self._open = not text.endswith("\n")
                self._when = time.monotonic()
                if not self._open:
                    self._turn.notify_all()
            return written

    def write(self, text: str) -> None:
        """Write the relay's ``text`` (whole lines) at the end of the process' current line."""
        deadline = time.monotonic() + WAIT
        with self._turn:
            while self._open:
                now = time.monotonic()
                quiet = self._when + PAUSE
                if now >= quiet or now >= deadline:
                    break
                self._turn.wait(min(quiet, deadline) - now)
            self.stream.write(text)  # type: ignore
            self.stream.flush()  # type: ignore

    def flush(self) -> None:
        self.stream.flush()  # type: ignore

    def fileno(self) -> int:
        return self.stream.fileno()  # type: ignore

    def isatty(self) -> bool:
        return is_terminal(self.stream)


class _Own(object):
    """The process' side of a :class:`SharedStream`, in place of ``sys.stdout``: its writes mark where its line
    stands; everything else is the stream's own (``isatty``, ``fileno``, ``encoding``, ``buffer``)."""

    def __init__(self, shared: SharedStream) -> None:
        self.shared = shared

    def write(self, text: str) -> int:
        return self.shared._own_write(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> object:
        return getattr(self.shared.stream, name)


class Lines(object):
    """A stream's bytes as the lines a terminal ends up showing.

    ``\\n`` ends a line. ``\\r`` starts it over: the text after it replaces the line, which is what a progress bar
    means (Keras pads a shorter update with spaces). ``\\b`` takes back the character before it where text follows
    (a spinner) and means nothing before a ``\\r`` (Keras writes a row of them before each update). UTF-8 is decoded
    across chunk boundaries, bad bytes replaced.

    A progress bar left unfinished, then continued :data:`PAUSE` seconds or more later by text that starts with no
    ``\\r``, was left by its writer: the continuation is another line (a warning on stderr or a log message, which
    share the pipe), and the bar's last state is finished as a line of its own, where a terminal would show the two
    glued on one row. The pieces of one ``print()`` come microseconds apart and stay together.

    Examples:
        >>> lines = Lines()
        >>> lines.feed(b"Epoch 1/2\\n 1/3 \\x1b[1m.\\x1b[0m\\r 2/3 ..")
        ['Epoch 1/2']
        >>> lines.current
        ' 2/3 ..'
        >>> lines.feed(b"\\b\\b\\b\\r 3/3 ...\\r\\n")
        [' 3/3 ...']
    """

    def __init__(self) -> None:
        self._decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        #: The unfinished line's latest state.
        self.current = ""
        #: Whether the unfinished line was started over (``\r``): a progress bar, not a line still being written.
        self.rewritten = False
        self._restart = False  # a \r was seen: the next text starts the line over
        self._back = 0  # \b seen since the last text
        self._when = 0.0  # when the last chunk came

    def feed(self, data: bytes, final: bool = False, now: Optional[float] = None) -> List[str]:
        """The lines ``data`` finishes; with ``final`` (the stream's end) the unfinished one too. ``now``: when
        ``data`` was read (default: ``time.monotonic()``)."""
        done = []
        text = self._decode(data, final)
        now = time.monotonic() if now is None else now
        if (self.rewritten and self.current and not self._restart and not self._back and text[:1].strip()
                and text[0] not in "\b\x1b" and now - self._when >= PAUSE):
            done.append(self.current)  # the bar as it was left; the text starts a line of its own
            self.current, self.rewritten = "", False
        self._when = now
        for piece in _CONTROL.split(text):
            if piece == "\n":
                done.append(self.current)
                self.current, self.rewritten, self._restart, self._back = "", False, False, 0
            elif piece == "\r":
                self._restart, self._back = True, 0
                self.rewritten = True
            elif piece == "\b":
                self._back += 1
            elif piece:
                if self._restart:
                    self.current = ""
                elif self._back:
                    self.current = self.current[:max(0, len(self.current) - self._back)]
                self._restart, self._back = False, 0
                self.current += piece
        if final and self.current:
            done.append(self.current)
            self.current, self.rewritten = "", False
        return done


def _fit(text: str, columns: Optional[int]) -> str:
    """``text`` cut to ``columns`` visible characters (escape sequences take none), so it stays on one row."""
    if columns is None or len(text) <= columns:
        return text
    kept, seen, start = [], 0, 0
    for match in list(_ESCAPE.finditer(text)) + [None]:
        plain = text[start:match.start() if match else len(text)]
        if seen + len(plain) > columns:
            kept.append(plain[:columns - seen])
            return "".join(kept) + (_RESET if "\x1b" in text else "")
        kept.append(plain)
        seen += len(plain)
        if match is None:
            break
        kept.append(match.group())
        start = match.end()
    return "".join(kept)


class Console(object):
    """Where the lines of every process meet: one lock, so lines of different processes never mix.

    On a terminal (``in_place``) an unfinished line is shown in place, prefix and its latest state rewritten after a
    ``\\r``; a finished line of any process clears that row, is written, and the unfinished line is drawn again below
    it. Several unfinished lines take turns on the one row (the last updated shows). Elsewhere only finished lines are
    written, without colour codes.

    Args:
        stream: a text stream (the launcher's stdout).
        terminal: whether ``stream`` is a terminal; default: ask it.
        shared: another writer uses ``stream`` too (rank 0 of a self-launched job writes its own output): nothing
            is shown in place, and on a terminal each line first clears the row, which may hold that writer's
            progress bar (drawn again at its next update).
    """

    def __init__(self, stream: object, terminal: Optional[bool] = None, shared: bool = False) -> None:
        self.stream = stream
        self.terminal = is_terminal(stream) if terminal is None else terminal
        self.in_place = self.terminal and not shared
        self.lock = threading.Lock()
        self._open = collections.OrderedDict()  # type: collections.OrderedDict  # key -> prefix + text, last updated last

    def lines(self, key: str, prefix: str, lines: List[str]) -> None:
        """Write ``key``'s finished ``lines``, each after ``prefix``."""
        if not lines:
            return
        with self.lock:
            cleared = bool(self._open) or (self.terminal and not self.in_place)
            self._open.pop(key, None)
            text = "".join(prefix + (line if self.terminal else strip_escapes(line)) + "\n" for line in lines)
            self._write(("\r" + _CLEAR if cleared else "") + text + self._shown())

    def update(self, key: str, prefix: str, text: str) -> None:
        """Show ``key``'s unfinished line, ``text``, in place (on a terminal; elsewhere nothing)."""
        if not self.in_place:
            return
        with self.lock:
            if self._open and next(reversed(self._open)) == key and self._open[key] == prefix + text:
                return
            self._open.pop(key, None)
            self._open[key] = prefix + text
            self._write("\r" + self._shown())

    def message(self, stream: object, text: str) -> None:
        """Write ``text`` (the launcher's own words) to ``stream``, which may show on the same terminal: the
        unfinished line is cleared first and drawn again after."""
        with self.lock:
            if self._open:
                self._write("\r" + _CLEAR)
            stream.write(text)  # type: ignore
            stream.flush()  # type: ignore
            if self._open:
                self._write(self._shown())

    def _shown(self) -> str:
        """The last updated unfinished line, cut to the terminal's width, and the rest of its row cleared."""
        if not self._open:
            return ""
        line = next(reversed(self._open.values()))
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns - 1  # type: ignore
        except (AttributeError, ValueError, OSError):
            columns = None
        return _fit(line, columns if columns and columns > 0 else None) + _CLEAR

    def _write(self, text: str) -> None:
        if not text:
            return
        try:
            self.stream.write(text)  # type: ignore
        except UnicodeEncodeError:  # a stream that can't encode a bar's '━'
            encoding = getattr(self.stream, "encoding", None) or "ascii"
            self.stream.write(text.encode(encoding, "replace").decode(encoding))  # type: ignore
        self.stream.flush()  # type: ignore


class Relay(object):
    """One process' output: its lines to the console under its prefix (where ``shown``), every line to its log file
    (collapsed, no colour codes), and, where not shown, its last :data:`TAIL` lines kept (:attr:`tail`) to report
    a failure with.

    Args:
        console: the :class:`Console` every process of the job writes to.
        label: the process' name, ``"rank 1"``; its lines are prefixed ``"[rank 1] "``.
        shown: whether its lines go to the console.
        log: a text file for the whole output, or None; closed at the stream's end.
    """

    def __init__(self, console: Console, label: str, shown: bool = True, log: object = None) -> None:
        self.console = console
        self.key = label
        self.prefix = "[{}] ".format(label)
        self.shown = shown
        self.log = log
        self.tail = collections.deque(maxlen=TAIL)  # type: collections.deque
        self.thread = None  # type: Optional[threading.Thread]
        self._lines = Lines()

    def feed(self, data: bytes, final: bool = False) -> None:
        """Relay the chunk ``data`` of the process' output; ``final`` at the stream's end."""
        done = self._lines.feed(data, final)
        if self.log is not None and done:
            self.log.write("".join(strip_escapes(line) + "\n" for line in done))  # type: ignore
            self.log.flush()  # type: ignore
        if not self.shown:
            self.tail.extend(done)
            return
        self.console.lines(self.key, self.prefix, done)
        if self._lines.current and self._lines.rewritten:
            self.console.update(self.key, self.prefix, self._lines.current)

    def start(self, stream: object) -> threading.Thread:
        """Read ``stream`` (a binary pipe) in a daemon thread until its end, relaying each chunk as it comes."""
        self.thread = threading.Thread(target=self._pump, args=(stream,), name="distkeras-relay " + self.key,
                                       daemon=True)
        self.thread.start()
        return self.thread

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the stream's end (a process the worker started may hold it open)."""
        if self.thread is not None:
            self.thread.join(timeout)

    def _pump(self, stream):
        # os.read returns what the pipe holds as soon as it holds anything: a "\r" update without "\n" is seen at
        # once, where readline() would wait for the line's end.
        fd = stream.fileno()
        settled = True  # nothing waits to be shown
        relaying = True  # until writing fails (a closed stdout, `| head` gone): then the pipe is only drained,
        # so that the worker never blocks on a full pipe
        while True:
            try:
                if relaying and not settled and not select.select([fd], [], [], SETTLE)[0]:
                    self.console.update(self.key, self.prefix, self._lines.current)
                    settled = True
                data = os.read(fd, _CHUNK)
            except (OSError, ValueError):  # the pipe closed under us (a pty's end reads as EIO)
                data = b""
            if not data:
                break
            relaying = relaying and self._feed(data)
            settled = not (self.shown and self.console.in_place and self._lines.current and not self._lines.rewritten)
        if relaying:
            self._feed(b"", final=True)
        if self.log is not None:
            self.log.close()  # type: ignore
        try:
            stream.close()
        except OSError:
            pass

    def _feed(self, data, final=False):
        try:
            self.feed(data, final)
            return True
        except (OSError, ValueError):  # the console or the log can't be written (a closed stream, a full disk)
            return False
