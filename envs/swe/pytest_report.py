"""A pytest plugin that writes one JSON line per test outcome: `-p bpo_swe_report`.

The jail copies this file (as `bpo_swe_report.py`) into a folder on the command's PYTHONPATH; it
needs only pytest. Each line is `{"nodeid", "when", "outcome", "message"}` with `when` one of
"collect", "setup", "call", "teardown" and `outcome` one of "passed", "failed", "skipped",
"xfailed", "xpassed". Lines are flushed as they come, so a run killed by its timeout still
reports the tests that finished. `envs.swe.results.summarize` folds them into one outcome per
test.

The report path comes from $BPO_SWE_REPORT, which the plugin removes from the environment before
any test code runs.
"""

import json
import os

_PATH = os.environ.pop("BPO_SWE_REPORT", None)
_FILE = None


def _write(record):
    global _FILE
    if _PATH is None:
        return
    if _FILE is None:
        _FILE = open(_PATH, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the session.
    _FILE.write(json.dumps(record) + "\n")
    _FILE.flush()


def _message(report):
    longrepr = getattr(report, "longrepr", None)
    if longrepr is None:
        return ""
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return str(crash.message)[:2000]
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # A skip: (path, line, reason).
        return str(longrepr[2])[:2000]
    return str(longrepr)[-2000:]


def pytest_runtest_logreport(report):
    outcome = report.outcome
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    record = {"nodeid": report.nodeid, "when": report.when, "outcome": outcome}
    if outcome in ("failed", "skipped"):
        record["message"] = _message(report)
    _write(record)


def pytest_collectreport(report):
    if report.failed:
        _write(
            {
                "nodeid": report.nodeid,
                "when": "collect",
                "outcome": "failed",
                "message": _message(report),
            }
        )
