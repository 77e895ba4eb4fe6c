"""pytest plugin for ``benchmark.py suite`` (``-p suite_timeline``): each test's start and end on its worker (and the
worker's resident memory after it), and
the host's busy share and memory in use every 2 s (from the controller, Linux's /proc/stat and /proc/meminfo), as
JSON lines in ``$ORB_SUITE_TRACE/timeline.jsonl``."""

import json
import os
import threading
import time

FOLDER = os.environ.get("ORB_SUITE_TRACE", "")
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_RECORD_TESTS = [bool(WORKER)]  # under pytest-xdist the workers record (the controller hears of each test too)


def _write(record: dict) -> None:
    with open(os.path.join(FOLDER, "timeline.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def pytest_runtest_logstart(nodeid, location):
    if FOLDER and _RECORD_TESTS[0]:
        _write(dict(event="start", worker=WORKER or "main", test=nodeid, t=time.time()))


def pytest_runtest_logfinish(nodeid, location):
    if FOLDER and _RECORD_TESTS[0]:  # (after the test's teardown: what the worker keeps into the next test)
        from orb.device import resident_gb  # (the tests import orb: it is on the workers' path)

        _write(dict(event="end", worker=WORKER or "main", test=nodeid, t=time.time(), resident_gb=resident_gb()))


def memory_in_use_gb() -> float:
    """The host's memory in use (MemTotal - MemAvailable), in GB: what a memory limit on the run would count, page
    cache aside."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0])
    return (fields["MemTotal"] - fields["MemAvailable"]) / 1e6


def _busy(interval: float = 2.0) -> None:
    before = None
    baseline = memory_in_use_gb()
    while True:
        try:
            with open("/proc/stat") as f:
                ticks = [int(x) for x in f.readline().split()[1:]]
        except OSError:
            return
        idle, total = ticks[3] + ticks[4], sum(ticks)
        if before is not None and total > before[1]:
            _write(dict(event="cpu", t=time.time(), seconds=interval,
                        busy=1.0 - (idle - before[0]) / (total - before[1]), memory_gb=memory_in_use_gb() - baseline))
        before = (idle, total)
        time.sleep(interval)


def pytest_configure(config):
    if FOLDER and not WORKER:
        _RECORD_TESTS[0] = not getattr(config.option, "numprocesses", None)  # no workers: this process runs them
        threading.Thread(target=_busy, daemon=True).start()
