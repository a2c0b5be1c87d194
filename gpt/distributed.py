"""A multi-host job: joining it, and stopping every process when one of them fails.

`jax.distributed` joins the processes: a coordination service on process 0, a client on each.
Without more, a process that stops with an error mid-run strands the others: they wait in the
step's collective for it, and it waits at jax's exit barrier for them, until that barrier's
5-minute timeout aborts them all with C++ stack traces. So once a process has joined:

- when it stops with an error (`gpt.errors.run_main` hands it to `_leave`), it prints it,
  posts the line in the coordination service's key-value store, waits until every other process
  has read it or failed too (at most `READ_WAIT_S`), and exits with its own status at once,
  skipping the exit barrier;
- a daemon thread waits on that store (a long poll on a key of its own, which a failing process
  sets for every other: one call per 10 s per process while all is well, not a read a second);
  on another process's error it prints `error: process N stopped (its error); this process stops
  too` and exits with the same status.
  Process 0 hosts the store, so it leaves last (the others' clients abort when it goes).

A process killed outright (SIGKILL, the kernel's out-of-memory killer) posts nothing: XLA's own
checks then stop the others, with its messages: at once when process 0 dies, after jax's
heartbeat timeout (60-100 s here) for another process.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import re
import signal
import sys
import threading
import time
from typing import Any, Callable

import jax

from gpt.errors import Report, UserError, on_failure

FAILED = "gpt/failed/"  # + process index -> {"status": exit status, "error": its line}
READ = "gpt/read/"  # + process index: it read another's failure and is stopping
LEFT = "gpt/left/"  # + process index: a failed process, exiting now
WAKE = "gpt/wake/"  # + process index: its watcher's long poll returns (a failure, or its own exit)
WATCH_TIMEOUT_S = 10.0  # a long poll returns at least this often, and the watcher looks anyway
POLL_S = 1.0  # the least time between two reads of the store by the watcher
GRACE_S = 1.0  # another's failure seen: how long this process's own main thread may claim first
READ_WAIT_S = 10.0  # how long a failing process waits for the others to read its line
WAIT_POLL_S = 0.2  # how often it looks meanwhile
EXIT_GRACE_S = 0.5  # process 0, last: the time the others take from their last post to their exit
BEFORE_STOP_S = 5.0  # at most this long for before_stopping's callbacks
HEARTBEAT_ENV = "GPT_DISTRIBUTED_HEARTBEAT"  # seconds without a heartbeat before a process is dead
HEARTBEAT_S = 100  # jax's default: a process killed outright stops the others after 60-100 s


@dataclasses.dataclass
class Job:
    """This process's view of the job, for the watcher thread and the failure hook."""
    client: Any  # jax's DistributedRuntimeClient
    me: int
    n: int
    done: threading.Event = dataclasses.field(default_factory=threading.Event)  # a normal exit
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    stopping: bool = False  # set once, under `lock`, by whichever thread reports a failure first

    def claim(self) -> bool:
        """Whether this thread is the first to stop the process for a failure (so only one
        error line is printed when this process fails as another's failure arrives)."""
        with self.lock:
            first, self.stopping = not self.stopping, True
        return first

    def stop_watching(self) -> None:
        """A normal exit: end the watcher's long poll. A call still pending in jax's client when
        the interpreter finalises aborts the process ("terminate called ...")."""
        self.done.set()
        _post(self, WAKE + str(self.me), "exit")


def init_distributed(coordinator_address: str = "", num_processes: int = 0, process_id: int = -1,
                     timeout_s: int | None = None) -> None:
    """`jax.distributed.initialize`, auto-detected on TPU/SLURM or explicit; a clear error on failure.

    Waits at most `timeout_s` (default: $GPT_DISTRIBUTED_TIMEOUT, else 300 s) for every process to
    join; a process that cannot reach the coordinator stops with a one-line error. Once joined, a
    process that fails stops the others (the module docstring).
    """
    timeout_s = _timeout(timeout_s)
    heartbeat_s = _seconds(HEARTBEAT_ENV, HEARTBEAT_S)
    kwargs = _job(coordinator_address, num_processes, process_id)
    # An unreachable coordinator (or a process that never starts) makes jax's client abort the whole
    # process with a C++ fatal log once its own deadline passes; a watchdog fires first and exits
    # with the usual one-line error instead.
    where = coordinator_address or "the auto-detected coordinator"
    n = f"all {num_processes}" if num_processes else "all the"

    def give_up() -> None:
        _say(f"error: could not join the distributed job at {where} within {timeout_s}s: not every "
             f"process connected; check --coordinator_address (reachable from this host, port open), "
             f"that {n} processes were started, and --num_processes/--process_id (wait longer with "
             f"GPT_DISTRIBUTED_TIMEOUT=SECONDS)")
        _exit(2)

    watchdog = threading.Timer(timeout_s, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(initialization_timeout=timeout_s + 60,
                                   heartbeat_timeout_seconds=heartbeat_s, **kwargs)
    except ValueError as e:
        if not coordinator_address and "coordinator_address" in str(e):
            raise UserError("--distributed found no TPU pod, SLURM or MPI job to join; pass "
                            "--coordinator_address=HOST:PORT --num_processes=N --process_id=I") from None
        raise _join_error(e, coordinator_address, timeout_s) from None
    except Exception as e:  # noqa: BLE001 - jax raises several types for an unreachable coordinator
        raise _join_error(e, coordinator_address, timeout_s) from None
    finally:
        watchdog.cancel()
    client = _client()
    if jax.process_count() > 1 and client is not None:
        watch(Job(client, jax.process_index(), jax.process_count()))
    elif jax.process_count() > 1 and jax.process_index() == 0:
        print("warning: this jax release hides its distributed client, so a process that fails "
              "mid-run is not announced: the others wait for it until jax's exit barrier times out "
              "(5 minutes)", file=sys.stderr, flush=True)


def _job(coordinator_address: str, num_processes: int, process_id: int) -> dict[str, Any]:
    """jax.distributed.initialize's explicit job (nothing: auto-detected), checked first."""
    if not coordinator_address:
        if num_processes or process_id != -1:
            raise UserError("--num_processes/--process_id need --coordinator_address=HOST:PORT "
                            "(or leave all three out on TPU pods and SLURM, where they are detected)")
        return {}
    check_address(coordinator_address)
    if num_processes < 1 or process_id < 0:
        got = ", ".join(f"--{k}={v}" for k, v, unset in (("num_processes", num_processes, 0),
                                                       ("process_id", process_id, -1)) if v < unset)
        raise UserError("--coordinator_address needs --num_processes=N (at least 1) and --process_id=I "
                        "(from 0)" + (f"; got {got}" if got else ""))
    if not 0 <= process_id < num_processes:
        raise UserError(f"--process_id={process_id} must be in [0, {num_processes})")
    return dict(coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id)


# HOST:PORT: a host name or IPv4 address, or an IPv6 address in brackets; a port of 1 to 5 digits
ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})", re.ASCII)


def check_address(address: str) -> None:
    """--coordinator_address must be HOST:PORT before jax sees it: given a port it cannot parse,
    jax's coordination service crashes the process (a segfault); given none, it fails with an
    IndexError, or waits out the whole timeout for a port outside 1..65535."""
    m = ADDRESS.fullmatch(address)
    if m is None or not 1 <= int(m[2]) <= 65535:
        raise UserError(f"--coordinator_address={address!r} must be HOST:PORT with a port from 1 to 65535, "
                        f"e.g. 10.0.0.1:1234 (an IPv6 host in brackets: [fd00::1]:1234)")


def _timeout(timeout_s: int | None) -> int:
    return timeout_s if timeout_s is not None else _seconds("GPT_DISTRIBUTED_TIMEOUT", 300)


def _seconds(name: str, default: int) -> int:
    """A whole number of seconds, at least 1, from environment variable `name` (else `default`)."""
    raw = os.environ.get(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        raise UserError(f"{name}={raw!r} must be a whole number of seconds") from None
    if value < 1:
        raise UserError(f"{name}={raw!r} must be at least 1 second")
    return value


def _join_error(e: Exception, coordinator_address: str, timeout_s: int) -> UserError:
    where = coordinator_address or "the auto-detected coordinator"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return UserError(f"could not join the distributed job at {where} within {timeout_s}s "
                     f"({first[:200]}); check --coordinator_address and that every process "
                     f"was started")


def _client() -> Any | None:
    """jax's client of the coordination service, as Orbax reaches it (jax has no public name for
    it); None if a jax release moves it, and then failures are not shared (as before this module)."""
    try:
        from jax._src import distributed as jax_distributed
        client = jax_distributed.global_state.client
    except (ImportError, AttributeError):
        return None
    needed = ("key_value_set", "key_value_dir_get", "blocking_key_value_get")
    return client if all(hasattr(client, name) for name in needed) else None


def watch(job: Job) -> threading.Thread:
    """Start reading the store for other processes' failures, and have this process's own
    failure posted there; stop reading at a normal exit, before jax's exit barrier (atexit runs
    the latest registration first, and jax registered its shutdown at import)."""
    on_failure(lambda status, line, report: _leave(job, status, line, report))
    thread = threading.Thread(target=_watch, args=(job,), name="gpt-job-watch", daemon=True)
    thread.start()

    def stop() -> None:
        job.stop_watching()
        thread.join(timeout=WATCH_TIMEOUT_S + 2 * POLL_S)  # woken at once unless the post failed
    atexit.register(stop)
    return thread


def _watch(job: Job) -> None:
    """The watcher thread: has another process posted a failure? Then stop this one too, after
    GRACE_S: an error that every process raises at once (a start-up mismatch, a non-finite loss)
    is then reported by each process's own main thread, as its own line."""
    while not job.done.is_set():
        started = time.monotonic()
        _long_poll(job)
        if job.done.is_set():
            return
        try:
            others = failures(job.client.key_value_dir_get(FAILED), job.me, job.n)
        except Exception:  # noqa: BLE001 - the store unreachable: jax's own checks handle that
            others = []
        if not others:
            if time.monotonic() - started < POLL_S:  # answered at once (a store in trouble, a
                job.done.wait(POLL_S)  # wake key already set): no busy loop
            continue
        if job.done.wait(GRACE_S) or not job.claim():
            return  # a normal exit, or this process's own failure is being reported
        who, status, line = others[0]
        try:
            _say(f"error: process {who} stopped ({line}); this process stops too")
            _run_before_stopping()
            _flush()  # before READ: process 0 may stop the store as soon as it sees it
            _post(job, READ + str(job.me), "1")
            if job.me == 0:  # it hosts the store: the others leave first, or XLA aborts them
                _wait_for(job, (READ, LEFT))
        finally:
            _exit(status)


def _long_poll(job: Job) -> None:
    """Wait until this process's wake key is set, or WATCH_TIMEOUT_S."""
    try:
        job.client.blocking_key_value_get(WAKE + str(job.me), int(WATCH_TIMEOUT_S * 1000))
    except Exception:  # noqa: BLE001 - the timeout, or the store unreachable: the caller reads anyway
        pass


def before_stopping(callback: Callable[[], None]) -> None:
    """Have `callback` run (at most BEFORE_STOP_S in all) when another process's failure stops this
    one: what it buffers (TensorBoard events) is then on disk. The main thread is blocked, in a
    collective that will not complete, so the callback runs on the watcher's side; a no-op outside
    a multi-host job."""
    if jax.process_count() > 1:
        _before_stopping.append(callback)


_before_stopping: list[Callable[[], None]] = []


def _run_before_stopping() -> None:
    def run_all() -> None:
        for callback in _before_stopping:
            try:
                callback()
            except Exception:  # noqa: BLE001 - stopping anyway: a flush that fails loses only its buffer
                pass
    worker = threading.Thread(target=run_all, name="gpt-before-stopping", daemon=True)
    worker.start()
    worker.join(BEFORE_STOP_S)  # a flush hung on a dead file system must not keep the process up


def failures(entries: list[tuple[str, str]], me: int, n: int) -> list[tuple[int, int, str]]:
    """The other processes' posted failures as (process, exit status, line), by process index.
    Only our own processes write the store, but what is read back is still checked like input:
    a process index in [0, n), a status in 1..255 (else 1), one printable line of at most 500
    characters."""
    found = []
    for key, value in entries:
        who = _process_of(key)
        if not (who.isascii() and who.isdecimal()) or int(who) == me or int(who) >= n:
            continue
        try:
            record = json.loads(value)
        except (ValueError, RecursionError):
            record = None
        record = record if isinstance(record, dict) else {}
        status, line = record.get("status"), record.get("error")
        status = status if isinstance(status, int) and 1 <= status <= 255 else 1
        line = "".join(c if c.isprintable() else " " for c in line) if isinstance(line, str) else ""
        found.append((int(who), status, " ".join(line.split())[:500] or "no message"))
    return sorted(found)


def _process_of(key: str) -> str:
    """The process index a key of the store ends in ("gpt/failed/3" -> "3"), as text."""
    return key.rstrip("/").rsplit("/", 1)[-1]


def _leave(job: Job, status: int, line: str, report: Report) -> None:
    """This process failed: post its error, print it, wait until the others have read it or
    failed too (process 0, which hosts the store, until they have left), and exit with `status`
    without jax's exit barrier. Whatever goes wrong on the way, the process exits."""
    if not job.claim():  # another process's failure is already stopping this one
        threading.Event().wait()
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut this short
    except ValueError:  # not the main thread
        pass
    try:
        _post(job, FAILED + str(job.me), json.dumps({"status": status, "error": line}))
        _wake_others(job)
        try:
            report()
        except (OSError, ValueError):  # stderr on the full disk, or closed
            pass
        _flush()  # before LEFT: process 0 may stop the store as soon as it sees it
        _wait_for(job, (READ, LEFT) if job.me == 0 else (READ, LEFT, FAILED))
        if job.me == 0:
            time.sleep(EXIT_GRACE_S)  # the others are between their last post and their exit
        _post(job, LEFT + str(job.me), "1")
    finally:
        _exit(status)


def _wait_for(job: Job, dirs: tuple[str, ...]) -> None:
    """Until every other process has a key in one of `dirs`, the store is gone, or READ_WAIT_S."""
    deadline = time.monotonic() + READ_WAIT_S
    while time.monotonic() < deadline:
        try:
            heard = {_process_of(key) for d in dirs
                     for key, _ in job.client.key_value_dir_get(d)}
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to wait for
            return
        if all(str(i) in heard for i in range(job.n) if i != job.me):
            return
        time.sleep(WAIT_POLL_S)


def _wake_others(job: Job) -> None:
    """End the other processes' long polls, so they read this failure now; a post that fails
    (the store slow or gone) stops the round, since each would wait as long: those not woken
    find the failure within WATCH_TIMEOUT_S."""
    for i in range(job.n):
        if i != job.me and not _post(job, WAKE + str(i), "failed"):
            return


def _post(job: Job, key: str, value: str) -> bool:
    """Set a key, once: a key already there, or a store already gone, leaves nothing to do.
    Whether the store answered (a key already there counts: another process set it)."""
    try:
        job.client.key_value_set(key, value)
    except Exception as e:  # noqa: BLE001 - see the docstring
        return "ALREADY_EXISTS" in str(e)
    return True


def _say(line: str) -> None:
    """One line on stderr, starting a line of its own on a terminal (a progress bar may be mid-line
    there); an unwritable stderr must not keep this process from leaving."""
    try:
        print(("\n" if sys.stderr.isatty() else "") + line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _exit(status: int) -> None:
    """End the process now, from any thread: the main thread may be blocked in a collective that
    will never complete, and jax's exit barrier would wait for the others."""
    _flush()
    os._exit(status)
