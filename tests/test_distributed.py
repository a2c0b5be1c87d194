"""gpt.distributed: a failing process posts its error and exits; the others read it and stop with one
line and the same status; process 0 (which hosts the store) leaves last. Here against an in-memory
store and threads; tests/test_multihost.py runs real two-process jobs."""
from __future__ import annotations

import json
import re
import threading

import pytest

from gpt import distributed
from gpt.errors import UserError


class Store:
    """The coordination service's key-value calls that gpt.distributed makes, in memory."""

    def __init__(self):
        self.kv, self.lock = {}, threading.Condition()
        self.calls = []

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.lock:
            if key in self.kv and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.kv[key] = value
            self.lock.notify_all()

    def blocking_key_value_get(self, key, timeout_in_ms):
        with self.lock:
            self.calls.append(("get", key))
            if not self.lock.wait_for(lambda: key in self.kv, timeout_in_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.kv[key]

    def key_value_dir_get(self, prefix):
        with self.lock:
            self.calls.append(("dir", prefix))
            return sorted((k, v) for k, v in self.kv.items() if k.startswith(prefix))


class Exited(BaseException):
    def __init__(self, status):
        self.status = status


@pytest.fixture
def exits(monkeypatch, capsys):
    """distributed._exit records (thread name, status) and ends the calling thread instead."""
    seen = []

    def fake_exit(status, line=None):
        if line is not None:
            print(line, file=__import__("sys").stderr)
        seen.append((threading.current_thread().name, status))
        raise Exited(status)
    monkeypatch.setattr(distributed, "_exit", fake_exit)
    for name, value in [("POLL_S", 0.01), ("GRACE_S", 0.02), ("READ_WAIT_S", 2.0), ("WAIT_POLL_S", 0.01),
                        ("EXIT_GRACE_S", 0.01)]:
        monkeypatch.setattr(distributed, name, value)
    return seen


@pytest.fixture
def threads():
    """Start daemon threads; at the end, stop every job's watcher and check that all ended (a
    protocol that hangs fails here instead of hanging the test run)."""
    started, jobs = [], []

    def start(target, *args, name):
        t = threading.Thread(target=lambda: _swallow(target, *args), name=name, daemon=True)
        t.start()
        started.append(t)
        jobs.extend(a for a in args if isinstance(a, distributed.Job))
        return t
    yield start
    for job in jobs:
        job.stop_watching()
    for t in started:
        t.join(5)
    assert not [t.name for t in started if t.is_alive()]


def leave(job, status, line, printed):
    distributed._leave(job, status, line, lambda: printed.append(line))


def _swallow(fn, *args):
    try:
        fn(*args)
    except Exited:
        pass


def test_a_failure_stops_the_others_with_its_status_and_line(exits, threads, capsys):
    store = Store()
    jobs = [distributed.Job(store, i, 3) for i in range(3)]
    watchers = [threads(distributed._watch, j, name=f"watch{j.me}") for j in jobs[:2]]
    printed = []  # process 2's main thread fails
    threads(leave, jobs[2], 2, "No space left on device", printed, name="main2").join(5)
    for w in watchers:
        w.join(5)
    assert printed == ["No space left on device"]
    assert sorted(exits) == [("main2", 2), ("watch0", 2), ("watch1", 2)]
    err = capsys.readouterr().err.splitlines()
    assert err.count("error: process 2 stopped (No space left on device); this process stops too") == 2
    kv = dict(store.kv)
    assert json.loads(kv["gpt/failed/2"]) == {"status": 2, "error": "No space left on device"}
    assert {"gpt/read/0", "gpt/read/1", "gpt/left/2"} <= set(kv)


def test_process_0_leaves_after_the_failed_process(exits, threads, monkeypatch):
    """Process 0 hosts the store: when another process fails, process 0 exits only once that one
    has posted that it is leaving."""
    store = Store()
    p0, p1 = distributed.Job(store, 0, 2), distributed.Job(store, 1, 2)
    order = []
    real_exit = distributed._exit

    def record(status, line=None):
        order.append(threading.current_thread().name)
        real_exit(status, line)
    monkeypatch.setattr(distributed, "_exit", record)
    w0 = threads(distributed._watch, p0, name="watch0")
    threads(leave, p1, 1, "RuntimeError: a bug", [], name="main1").join(5)
    w0.join(5)
    assert order == ["main1", "watch0"] and "gpt/left/1" in store.kv


def test_failing_together_prints_each_own_line_once(exits, threads):
    """Every process fails at the same step (a non-finite loss): each prints only its own error and
    none waits for a reader that will never come."""
    store = Store()
    jobs = [distributed.Job(store, i, 2) for i in range(2)]
    printed = [[], []]
    for j in jobs:
        threads(distributed._watch, j, name=f"watch{j.me}")
    mains = [threads(leave, j, 2, "the loss became nan", printed[j.me], name=f"main{j.me}") for j in jobs]
    for t in mains:
        t.join(5)
    assert printed == [["the loss became nan"], ["the loss became nan"]]
    assert sorted(exits) == [("main0", 2), ("main1", 2)]


def test_a_store_that_fails_stops_the_wake_round():
    """A failing process wakes the others one post at a time; a post the store does not take
    (slow or gone) ends the round instead of waiting as long for each of thousands."""
    class Down(Store):
        def key_value_set(self, key, value, allow_overwrite=False):
            self.calls.append(("set", key))
            if key.startswith("gpt/wake/") and key not in self.kv:
                raise RuntimeError("UNAVAILABLE")
            super().key_value_set(key, value, allow_overwrite)
    store = Down()
    store.kv["gpt/wake/1"] = "exit"  # process 1 already left: an existing key still counts as heard
    distributed._wake_others(distributed.Job(store, 0, 5))
    assert store.calls == [("set", "gpt/wake/1"), ("set", "gpt/wake/2")]


def test_a_normal_exit_stops_the_watcher(exits, threads):
    """At a normal exit the watcher's pending long poll is ended (jax's client aborts the process
    if a call is still pending when the interpreter finalises)."""
    store = Store()
    job = distributed.Job(store, 1, 2)
    w = threads(distributed._watch, job, name="watch1")
    job.stop_watching()
    w.join(5)
    assert not w.is_alive() and exits == [] and store.kv == {"gpt/wake/1": "exit"}


def test_the_watcher_waits_on_the_store_instead_of_reading_it(exits, threads, monkeypatch):
    """While all is well a watcher makes one call per WATCH_TIMEOUT_S (a long poll), not one read
    per POLL_S; a failure wakes it at once."""
    monkeypatch.setattr(distributed, "WATCH_TIMEOUT_S", 0.2)
    store = Store()
    w = threads(distributed._watch, distributed.Job(store, 0, 2), name="watch0")
    threading.Event().wait(1.1)  # 110 reads at the POLL_S of the fixture
    calls = len(store.calls)
    assert 4 <= calls <= 12, store.calls  # 5 long polls, each with its read
    threads(leave, distributed.Job(store, 1, 2), 2, "bad data", [], name="main1").join(5)
    w.join(5)
    assert sorted(exits) == [("main1", 2), ("watch0", 2)]


def test_only_one_thread_reports():
    job = distributed.Job(Store(), 0, 2)
    assert job.claim() and not job.claim()


@pytest.mark.parametrize("value, want", [
    ('{"status": 2, "error": "bad  data\\nhere"}', (2, "bad data here")),
    ('{"status": 0, "error": "x"}', (1, "x")),
    ('{"status": "2", "error": 5}', (1, "no message")),
    ('[1, 2]', (1, "no message")),
    ('not json', (1, "no message")),
    ("[" * 100_000 + "]" * 100_000, (1, "no message")),
    ('{"status": 2, "error": "\\u001b[2Jclear\\u0007"}', (2, "[2Jclear")),
    ('{"status": 3, "error": "' + "y" * 900 + '"}', (3, "y" * 500)),
])
def test_posted_failures_are_checked(value, want):
    """What the store holds is read back as data: a status in 1..255 (else 1), one printable line
    of at most 500 characters; this process's own entry and keys that are not an index of this
    job's processes are skipped."""
    entries = [("gpt/failed/1", value), ("gpt/failed/0", '{"status": 2, "error": "mine"}'),
               ("gpt/failed/x", '{"status": 2, "error": "?"}'), ("gpt/failed/\u00b2", "{}"),
               ("gpt/failed/7", '{"status": 2, "error": "not in this job"}')]
    assert distributed.failures(entries, me=0, n=3) == [(1, *want)]


def test_a_failure_that_cannot_be_printed_still_ends_the_process(exits, threads):
    """stderr on the full disk: the error is still posted, the others still stop, and this process
    still exits (not into jax's exit barrier)."""
    store = Store()
    p0, p1 = distributed.Job(store, 0, 2), distributed.Job(store, 1, 2)
    w0 = threads(distributed._watch, p0, name="watch0")

    def unprintable():
        raise OSError(28, "No space left on device")
    threads(distributed._leave, p1, 2, "No space left on device", unprintable, name="main1").join(5)
    w0.join(5)
    assert sorted(exits) == [("main1", 2), ("watch0", 2)] and "gpt/failed/1" in store.kv


def test_buffered_logs_are_flushed_before_stopping(exits, threads, monkeypatch):
    """Stopped for another process's failure, this process first runs its before-stopping
    callbacks (the TensorBoard flush); one that fails or hangs does not keep it from stopping."""
    ran = []
    monkeypatch.setattr(distributed, "BEFORE_STOP_S", 0.3)
    monkeypatch.setattr(distributed, "_before_stopping", [
        lambda: ran.append("flushed"), lambda: 1 / 0, lambda: threading.Event().wait(), lambda: ran.append("late")])
    store = Store()
    store.key_value_set("gpt/failed/1", '{"status": 2, "error": "bad data"}')
    store.key_value_set("gpt/wake/0", "failed")  # as process 1's _leave posts it
    threads(distributed._watch, distributed.Job(store, 0, 2), name="watch0").join(5)
    assert ran == ["flushed"] and exits == [("watch0", 2)]


@pytest.mark.parametrize("raw, want", [(None, 100), ("10", 10), ("ten", "whole number"), ("0", "at least 1")])
def test_heartbeat_setting(monkeypatch, raw, want):
    """GPT_DISTRIBUTED_HEARTBEAT: how long without a heartbeat before jax declares a process dead
    (a process killed outright stops the others after about that long); checked like the command
    line."""
    if raw is None:
        monkeypatch.delenv(distributed.HEARTBEAT_ENV, raising=False)
    else:
        monkeypatch.setenv(distributed.HEARTBEAT_ENV, raw)
    if isinstance(want, int):
        assert distributed._seconds(distributed.HEARTBEAT_ENV, distributed.HEARTBEAT_S) == want
    else:
        with pytest.raises(UserError, match=f"GPT_DISTRIBUTED_HEARTBEAT=.*{want}"):
            distributed._seconds(distributed.HEARTBEAT_ENV, distributed.HEARTBEAT_S)


@pytest.mark.parametrize("address", ["127.0.0.1:abc", "localhost:1234x", "[::1]", "127.0.0.1:-1",
                                     "127.0.0.1:", "127.0.0.1:70000", "127.0.0.1", "host:0", ":1234",
                                     "http://host:1234", "127.0.0.1:12355?x", "127.0.0.1:12355#", "my host:1234",
                                     "h\n:1234", "[fe80::1%eth0]:1234"])
def test_a_malformed_coordinator_address_is_one_line(address):
    """jax's coordination service segfaults on a port it cannot parse and waits out its timeout on
    one out of range, so the address is checked before jax sees it."""
    with pytest.raises(UserError, match="must be HOST:PORT with a port from 1 to 65535"):
        distributed.init_distributed(address, 2, 0)


@pytest.mark.parametrize("address", ["127.0.0.1:1234", "[::1]:1234", "node-3.cluster:8476"])
def test_well_formed_coordinator_addresses_pass(address):
    distributed.check_address(address)


@pytest.mark.parametrize("n, i, words", [
    (0, 0, "needs --num_processes=N"), (-2, 0, "got --num_processes=-2"), (2, -3, "got --process_id=-3"),
    (2, 2, "--process_id=2 must be in [0, 2)")])
def test_process_numbers_are_checked(n, i, words):
    with pytest.raises(UserError, match=re.escape(words)):
        distributed.init_distributed("127.0.0.1:1234", n, i)


def test_process_numbers_without_an_address_are_refused():
    """--num_processes/--process_id alone would train a run of its own in the shared out_dir."""
    for n, i in ((2, 1), (0, 0), (0, -3)):
        with pytest.raises(UserError, match="need --coordinator_address=HOST:PORT"):
            distributed.init_distributed("", n, i)
