"""What a launcher needs from a training process: a graceful stop, a heartbeat, the attempt number.

Graceful stop. SIGTERM (torchrun forwards it to every worker; SLURM and ``cluster`` send it
before SIGKILL) asks for a stop. The training loop looks at a flag at each step boundary, a
plain attribute read: no host sync and no collective per step. There rank 0 saves the last
completed step and every rank exits with 143 (128 + SIGTERM).

Ranks hear the signal at slightly different step boundaries, so a rank that stops may leave a
peer waiting in the next step's collective. Two things keep that peer from losing the step:

  - `StepLedger` remembers the last few completed optimizer steps; on CUDA two events per step
    mark where each parameter update starts and ends on the GPU's stream. A stop saves the
    newest step whose update has finished on the GPU and whose successor has not started,
    reading the tensors on a side stream, so it works even while later work sits stuck behind
    a collective that will never complete. Parameters and optimizer state only change inside
    the update, so that state is exactly the one of that step.
  - `GracefulStop` hears the signal in a thread (through ``signal.set_wakeup_fd``), because a
    main thread blocked in C (a collective, or a host sync behind one) never runs a Python
    signal handler. If the main thread has not taken the stop over within ``timeout_s``, the
    thread does the save itself and ends the process.

A collective that fails (gloo raises when its peer has gone) while a stop is requested leads
to the same save: the failed step never reached its update.
"""
from __future__ import annotations

import contextlib
from collections import deque
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable

import torch

RESTART_COUNT_ENV = "CLUSTER_RESTART_COUNT"
HEARTBEAT_ENV = "CLUSTER_HEARTBEAT_FILE"
STOP_EXIT_CODE = 128 + signal.SIGTERM  # 143: what a shell reports for a process ended by SIGTERM


def restart_count() -> int | None:
    """The launcher's attempt number (0 for the first), or None when it did not set one."""
    raw = os.environ.get(RESTART_COUNT_ENV, "").strip()
    try:
        return int(raw) if raw else None
    except ValueError:
        print(f"warning: {RESTART_COUNT_ENV}={raw!r} is not an integer; ignored", file=sys.stderr)
        return None


def exit_now(code: int = STOP_EXIT_CODE) -> None:
    """Leave at once: no process-group teardown, which can hang when a peer has gone."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Heartbeat:
    """Touches a file at most once per `every_s` seconds, for a launcher's hang watchdog.

    Called at every step boundary; the clock comparison is all it costs in between. A heartbeat
    that cannot be written warns once and never stops training.
    """

    def __init__(self, path: str | None, every_s: float = 1.0):
        self.path, self.every_s = path, every_s
        self.last = float("-inf")
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.beat()

    @classmethod
    def from_env(cls) -> "Heartbeat":
        return cls(os.environ.get(HEARTBEAT_ENV) or None)

    def beat(self) -> None:
        if not self.path:
            return
        now = time.monotonic()
        if now - self.last < self.every_s:
            return
        self.last = now
        try:
            try:
                os.utime(self.path)
            except FileNotFoundError:
                open(self.path, "a").close()
        except OSError as e:
            print(f"warning: heartbeat file {self.path}: {e}; no more heartbeats", file=sys.stderr)
            self.path = None

    @contextlib.contextmanager
    def section(self, name: str):
        """A long pause without steps (a checkpoint written): the file says `section NAME`
        while it lasts, so a launcher's timeout learned from the steps allows for it (cluster's
        --hang-timeout auto: its start-up allowance); a plain beat again when it ends."""
        self._write(f"section {name}\n")
        try:
            yield
        finally:
            self._write("")
            self.last = time.monotonic()

    def _write(self, text: str) -> None:
        """Replace the file's content (a new file renamed over it: a reader sees the old
        content or the new, never half of it); the move is a beat."""
        if not self.path:
            return
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
        except OSError as e:
            print(f"warning: heartbeat file {self.path}: {e}; no more heartbeats", file=sys.stderr)
            self.path = None


def to_cpu(obj):
    """A copy of `obj` with every tensor copied to the CPU (nested dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


class StepLedger:
    """The last `size` completed optimizer steps, each with what a checkpoint needs to place it.

    Every parameter update runs inside ``update(point)``; ``point()`` describes the run after
    it (step, epoch, position in the epoch, ...). ``capture(copy)`` returns the newest point
    whose update has finished, with ``copy()`` of the state taken at that point.
    """

    def __init__(self, device: torch.device, initial_point: dict, size: int = 32):
        self.cuda = device.type == "cuda"
        self.lock = threading.RLock()
        self.size = size
        self.count = 0  # updates recorded so far
        self.torn = False  # True while an update is half done (an exception left it so)
        self.initial = initial_point
        self.points: list[dict | None] = [None] * size
        if self.cuda:
            self.before = [torch.cuda.Event() for _ in range(size)]
            self.after = [torch.cuda.Event() for _ in range(size)]
            self.side = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def update(self, point: Callable[[], dict]):
        with self.lock:
            i = self.count % self.size
            if self.cuda:
                self.before[i].record()
            self.torn = True
            yield
            if self.cuda:
                self.after[i].record()
            self.points[i] = point()
            self.count += 1
            self.torn = False

    def newest(self) -> dict:
        return self.points[(self.count - 1) % self.size] if self.count else self.initial

    def _done(self, j: int) -> bool:
        """Has update j (0-based) finished on the device? j = -1 is the starting state."""
        return j < 0 or not self.cuda or self.after[j % self.size].query()

    def _started(self, j: int) -> bool:
        """Has update j begun on the device? (The one in progress counts once recorded.)"""
        recorded = j < self.count + (1 if self.torn else 0)
        return recorded and (not self.cuda or self.before[j % self.size].query())

    def wait_finished(self, wait_s: float) -> bool:
        """Wait up to `wait_s` for the newest update to finish on the device."""
        deadline = time.monotonic() + wait_s
        while not self._done(self.count - 1):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return True

    def capture(self, copy: Callable[[], dict], wait_s: float) -> tuple[dict, dict] | None:
        """(point, copy()) of the newest update finished on the device, or None when none of
        the remembered updates has finished (or one was left half done by an exception).

        Waits up to `wait_s` for the newest update to finish. Holds the lock, so no update
        starts meanwhile. On CUDA the lock is given up on after 2 s (the main thread can block
        inside an update when the GPU is stuck and the launch queue is full); the copy runs on
        a side stream that does not wait for the main stream, and counts only if the next
        update had not started on the GPU when it ended.
        """
        held = self.lock.acquire(timeout=2.0 if self.cuda else -1)
        try:
            deadline = time.monotonic() + wait_s
            while not self.torn or not held:
                while not self._done(self.count - 1) and time.monotonic() < deadline:
                    time.sleep(0.002)
                oldest = self.count - self.size if self.count > self.size else -1
                j = next((k for k in range(self.count - 1, oldest - 1, -1) if self._done(k)), None)
                if j is None:
                    return None
                if self._started(j + 1):
                    time.sleep(0.002)  # the update after j is running on the GPU: look again
                    continue
                if self.cuda:
                    with torch.cuda.stream(self.side):
                        state = copy()
                else:
                    state = copy()
                if not self._started(j + 1):
                    return (self.points[j % self.size] if j >= 0 else self.initial), state
            return None
        finally:
            if held:
                self.lock.release()


class StepPace:
    """How long a step boundary may still take (GracefulStop's patience): `steps` times the
    slowest of the last `keep` steps, at least `floor_s`. None (wait the whole --stop-timeout)
    before the first steps and while something longer than a step runs (a checkpoint written,
    an evaluation), whose time is not counted as a step's."""

    def __init__(self, steps: float = 3.0, floor_s: float = 1.0, keep: int = 8,
                 clock: Callable[[], float] = time.monotonic):
        self.steps, self.floor_s, self.clock = steps, floor_s, clock
        self.stamps: deque[float] = deque(maxlen=keep + 1)
        self.busy = 0

    def boundary(self) -> None:
        self.stamps.append(self.clock())

    @contextlib.contextmanager
    def long(self):
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1
            self.stamps.clear()
            self.stamps.append(self.clock())     # the next step counts from here

    def patience(self) -> float | None:
        if self.busy or len(self.stamps) < 3:
            return None
        s = list(self.stamps)
        return max(self.floor_s, self.steps * max(b - a for a, b in zip(s, s[1:])))


# How often the stop watchdog asks the patience while it waits for a step boundary.
PATIENCE_LOOK_S = 0.05


def _default_sigterm_in_child() -> None:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class GracefulStop:
    """SIGTERM -> a stop request that the training loop honours at its next step boundary.

    Phases: before ``begin_training`` a SIGTERM raises SystemExit(143) in the main thread
    (nothing to save yet). During training it only sets ``requested``. A watchdog thread wakes
    on the signal; if nobody has claimed the stop after `timeout_s` seconds, it claims it,
    calls the rescue function given to ``begin_training`` (None: nothing to save) and exits
    the process with 143. Or sooner: `patience` (given to ``begin_training``) says how long
    a step boundary may still take now, from the job's own step times; one that has not come
    in a few steps' time will not (the ranks wait in a collective on a peer that has gone,
    which the launcher stops them for), and waiting out `timeout_s` only delays the restart.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.requested = threading.Event()
        self._claimed = threading.Lock()
        self._rescue: Callable[[], None] | None = None
        self._patience: Callable[[], float | None] | None = None
        self._training = False

    def install(self) -> None:
        """Call once, from the main thread."""
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        signal.signal(signal.SIGTERM, self._handler)
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._fds = (reader, writer)  # keep both ends open for the life of the process
        threading.Thread(target=self._watch, args=(reader,), name="graceful-stop",
                         daemon=True).start()
        # Forked children (DataLoader workers) must not inherit either: with the wakeup fd a
        # SIGTERM to a worker would read, in this process, as a stop request; with the handler
        # a worker would ignore the SIGTERM that DataLoader's shutdown may send it.
        os.register_at_fork(after_in_child=_default_sigterm_in_child)

    def begin_training(self, rescue: Callable[[], None] | None,
                       patience: Callable[[], float | None] | None = None) -> None:
        self._rescue, self._patience, self._training = rescue, patience, True
        if self.requested.is_set():  # the signal came between the handler's check and now
            raise SystemExit(STOP_EXIT_CODE)

    def end_training(self) -> None:
        self._rescue, self._patience, self._training = None, None, False

    def claim(self) -> bool:
        """True for the first caller only: that one saves and exits."""
        return self._claimed.acquire(blocking=False)

    def _handler(self, signum, frame) -> None:  # noqa: ARG002
        self.requested.set()
        if not self._training:
            # Raising lets every try/finally run, so the process group is destroyed and
            # files are closed when we are stopped during set-up.
            raise SystemExit(STOP_EXIT_CODE)

    def _watch(self, reader: socket.socket) -> None:
        while True:
            got = reader.recv(64)
            if not got:
                return
            if signal.SIGTERM in got:
                break
        self.requested.set()
        waited = self._wait_for_boundary()
        if not self.claim():
            return  # the main thread is saving or exiting
        rescue = self._rescue
        try:
            if rescue is not None:
                print(f"stop: the main thread did not reach a step boundary within"
                      f" {waited:.3g} s; saving from the watchdog", file=sys.stderr, flush=True)
                rescue()
        finally:
            exit_now(STOP_EXIT_CODE)

    def _wait_for_boundary(self) -> float:
        """Seconds waited for the main thread: timeout_s, or less where patience says a step
        boundary would have come by now; a claim by the main thread ends the wait."""
        t0 = time.monotonic()
        while True:
            waited = time.monotonic() - t0
            patience = self._patience() if self._patience is not None else None
            limit = self.timeout_s if patience is None else min(self.timeout_s, patience)
            if waited >= limit or self._claimed.locked():
                return waited
            time.sleep(min(PATIENCE_LOOK_S, limit - waited))
