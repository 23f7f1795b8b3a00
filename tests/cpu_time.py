"""A pytest plugin for measuring the test tiers: CPU seconds per test (its process and the children it waited
for) and their sum, the idle wall time of these single-threaded tests whatever the machine's load. Used as
`python -m pytest -p tests.cpu_time ...` (docs/LOG.md, 2026-12-06); not loaded otherwise."""

import resource

import pytest

_times = {}


def _cpu():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = _cpu()
    yield
    _times[item.nodeid] = _cpu() - start


def pytest_terminal_summary(terminalreporter):
    rows = sorted(_times.items(), key=lambda kv: -kv[1])
    terminalreporter.write_line(f"CPU seconds of all tests: {sum(_times.values()):.1f} over {len(rows)} tests")
    for nodeid, t in rows[:45]:
        terminalreporter.write_line(f"{t:8.2f}s cpu  {nodeid}")
