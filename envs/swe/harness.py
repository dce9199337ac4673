"""Both ends of a pytest run's report: the grading harness, and the report plugin.

One file, two roles; each ships alone (the jail and the Docker executor copy it in).

- The report plugin (`-p bpo_swe_report`): the jail and the Docker executor put this file on
  the command's PYTHONPATH as `bpo_swe_report.py` for the agent's `test` runs, the task builder's
  runs and the official SWE-bench images' grading (Python 3.6 and later: this role keeps to
  their syntax). It writes one JSON line per test outcome to $BPO_SWE_REPORT (removed from the
  environment before any test code runs): `{"nodeid", "when", "outcome", "message"}` with `when`
  one of "collect", "setup", "call", "teardown" and `outcome` one of "passed", "failed",
  "skipped", "xfailed", "xpassed", flushed as they come, so a run killed by its timeout still
  reports the tests that finished. `envs.swe.results.summarize` folds them into one outcome per
  test.
- The grading harness, run as a program:

    python -P -s -B /.bpo_harness/harness.py --report-fd N [--path DIR]... [--agent-file F]...
        [--agent-def F::QUALNAME::KIND]... -- PYTEST_ARGS

`envs.swe.jail.run_harness` starts it (stdlib and pytest only). Why each piece:

- `-P -s` and no PYTHONPATH: neither the working folder nor anything the agent wrote is on
  `sys.path` while the interpreter, pytest, its plugins and this harness are imported. The
  repository's folders (`--path`) are put first on `sys.path` only after that, as the tests need.
- The report plugin is an object handed to `pytest.main(plugins=[...])`, never a module looked up
  by name, so no file can shadow it.
- Records go to descriptor N: a root-only file outside the jail's root (no path inside the jail
  leads to it). Each line is `HMAC-SHA256(key, json) json`; the key comes on stdin, which is
  then closed. Lines without a valid MAC (anything the code under test writes there without the
  key) are dropped by the reader, and the last line must be this harness's end record, which
  counts the records before it: a run that exits early (`os._exit` at import) or whose channel
  was written into has no valid end, and then no test counts as passed.
- The end record says whether the run stayed intact: before any repository code is imported the
  harness keeps a reference to every entry of `builtins` and to every function and class (and
  their methods) of pytest, pluggy, this harness, json, hashlib, os and io; after the session it
  checks that each is still the same object (a patched `builtins.len`, a replaced
  `_pytest.runner.call_and_report`, ...), that every plugin registered after the session
  started is pytest's own or a conftest module (conftest files come from the pristine tree),
  and that no plugin is a module the agent changed. The repository's own options are kept
  (its `addopts`, the plugins it loads with `-p` or `pytest_plugins`), as SWE-bench keeps them:
  they come from the pristine tree, so the agent cannot choose them, only (by editing a
  library module such a plugin is) the code of one, which this check refuses.
- An xfailed outcome counts (as in SWE-bench) only where the test has an `xfail` marker, or an
  imperative `pytest.xfail()` was raised with no frame in a file the agent changed.
- The assertion guard (`assert_guard.py`, shipped beside this file and loaded by its path
  before any repository code): comparisons of the tests that the code under test cannot fake,
  and an audit hook that records frame access and test reads by the definitions the agent
  wrote (`--agent-def`). Each such record is signed and written at once; the end record counts
  them (`inspections`) and the refused comparisons (`refused`), and the guard's configuration
  and pytest's rewrite hooks are part of the snapshot checked at the end.

What this cannot stop: code under test runs in this process and could, deliberately, read the
key out of this process's memory. See the repository-repair section of the README.
"""

import json
import os
import sys

# The report plugin --------------------------------------------------------------------------

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


def _collect_failure(report):
    return {"nodeid": report.nodeid, "when": "collect", "outcome": "failed",
            "message": _message(report)}  # fmt: skip


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
        _write(_collect_failure(report))


# The grading harness ------------------------------------------------------------------------

_TRACKED = ("builtins", "_pytest", "pytest", "pluggy", "__main__", "json", "_json", "hashlib",
            "_hashlib", "hmac", "os", "posix", "io", "_io", "unittest", "_bpo_guard",
            "operator", "_operator")  # fmt: skip
# Names whose rebinding changes no behaviour: `_` (sys.displayhook sets it, in doctests) and
# module metadata (six's tests, for one, reload modules, which rebinds `builtins.__spec__`).
_IGNORED = frozenset({"_", "__spec__", "__loader__", "__doc__", "__name__", "__package__"})
_fd_write = os.write
_encode = json.JSONEncoder(ensure_ascii=True, sort_keys=True).encode
_MISSING = object()


def _parse(argv):
    options = {"--report-fd": [], "--path": [], "--agent-file": [], "--agent-def": []}
    i = 0
    while i < len(argv) and argv[i] != "--":
        if argv[i] not in options or i + 1 >= len(argv):
            raise SystemExit(f"harness: bad argument {argv[i]!r}")
        options[argv[i]].append(argv[i + 1])
        i += 2
    return options, argv[i + 1 :]


def _load_guard():
    """The assertion guard (`assert_guard.py`), shipped beside this file, loaded by path."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assert_guard.py")
    spec = importlib.util.spec_from_file_location("_bpo_guard", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["_bpo_guard"] = module
    spec.loader.exec_module(module)
    return module


def _make_emit(fd, key, hmac_digest):
    count = [0]

    def emit(record):
        record = dict(record, seq=count[0])
        text = _encode(record).encode()
        line = hmac_digest(key, text, "sha256").hex().encode() + b" " + text + b"\n"
        count[0] += 1
        while line:
            line = line[_fd_write(fd, line) :]

    def emitted():
        return count[0]

    return emit, emitted


def _is_method(value):
    return callable(value) or isinstance(value, (staticmethod, classmethod, property))


def _snapshot():
    """(module, {name: object}, {class name: {attr: object}}) for every tracked module."""
    snap = []
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] not in _TRACKED:
            continue
        names = vars(module)
        if name == "builtins":
            entries = dict(names)
        else:
            entries = {k: v for k, v in names.items() if callable(v)}
        classes = {
            k: {a: v for a, v in vars(c).items() if _is_method(v)}
            for k, c in entries.items()
            if isinstance(c, type) and getattr(c, "__module__", None) == name
        }
        snap.append((name, module, entries, classes))
    return snap


def _tampered(snap):
    """What differs from the snapshot: a list of 'module.name' strings."""
    changed = []
    for name, module, entries, classes in snap:
        if sys.modules.get(name) is not module:
            changed.append(f"sys.modules[{name!r}]")
            continue
        names = vars(module)
        for attr, value in entries.items():
            if attr not in _IGNORED and names.get(attr, _MISSING) is not value:
                changed.append(f"{name}.{attr}")
        if name == "builtins":
            changed += [f"builtins.{a} (added)" for a in names.keys() - entries.keys()
                        if a not in _IGNORED]  # fmt: skip
        for cls_name, methods in classes.items():
            now = vars(entries[cls_name])
            changed += [f"{name}.{cls_name}.{a}" for a, v in methods.items()
                        if now.get(a, _MISSING) is not v]  # fmt: skip
    return changed


class _Reporter:
    """The report plugin (an object, registered by `pytest.main(plugins=[...])`)."""

    def __init__(self, emit, agent_files):
        self._emit = emit
        self._agent_files = frozenset(agent_files)
        self._start_plugins = set()
        self.late_plugins = []
        self.agent_plugins = []

    def pytest_sessionstart(self, session):
        self._pm = session.config.pluginmanager
        self._start_plugins = {id(p) for p in self._pm.get_plugins()}

    def pytest_sessionfinish(self, session):
        for plugin in self._pm.get_plugins():
            path = getattr(plugin, "__file__", None) or ""
            if path in self._agent_files:  # A plugin the repository's config loads (`-p`,
                # `pytest_plugins`) from a module the agent changed: its hooks decide outcomes.
                self.agent_plugins.append(path)
                continue
            if id(plugin) in self._start_plugins:
                continue
            if type(plugin).__module__.split(".")[0] in ("_pytest", "pytest"):
                continue  # pytest's own (its fixture manager registers at session start).
            if os.path.basename(path) != "conftest.py" or path in self._agent_files:
                self.late_plugins.append(getattr(plugin, "__name__", type(plugin).__name__))

    def pytest_runtest_makereport(self, item, call):
        # Outermost wrapper (see main): it sees the report as every other plugin left it.
        report = yield
        outcome = report.outcome
        message = ""
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
            if outcome == "xfailed" and item.get_closest_marker("xfail") is None:
                blamed = self._agent_frame(call)
                if blamed:
                    outcome = "failed"
                    message = f"pytest.xfail() raised from {blamed}, a file the agent changed"
        if outcome in ("failed", "skipped") and not message:
            message = _message(report)
        record = {"nodeid": report.nodeid, "when": report.when, "outcome": outcome}
        if message:
            record["message"] = message
        self._emit(record)
        return report

    def _agent_frame(self, call):
        excinfo = getattr(call, "excinfo", None)
        tb = excinfo.tb if excinfo is not None else None
        while tb is not None:
            filename = tb.tb_frame.f_code.co_filename
            if filename in self._agent_files:
                return filename
            tb = tb.tb_next
        return None

    def pytest_collectreport(self, report):
        if report.failed:
            self._emit(_collect_failure(report))


def main(argv):
    import importlib
    from _hashlib import hmac_digest

    options, pytest_args = _parse(argv)
    agent_files = options["--agent-file"]
    key = sys.stdin.buffer.readline().strip()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    emit, emitted = _make_emit(int(options["--report-fd"][0]), key, hmac_digest)
    del key
    import pytest
    from _pytest.config import default_plugins

    for name in default_plugins:  # What pytest.main imports anyway, but before any repo code.
        try:
            importlib.import_module(f"_pytest.{name}")
        except ImportError:
            pass
    # Marked here: the class is defined before pytest is imported.
    pytest.hookimpl(wrapper=True, tryfirst=True)(_Reporter.pytest_runtest_makereport)
    reporter = _Reporter(emit, agent_files)
    guard = _load_guard().Guard(
        agent_files, options["--agent-def"], lambda line: emit({"when": "inspection", "what": line})
    )
    config = (guard.files, {p: dict(k) for p, k in guard.defs.items()}, guard.report)
    rewrite = guard.install()
    snap = _snapshot()
    sys.path[0:0] = options["--path"]
    try:
        status = int(pytest.main(pytest_args, plugins=[reporter]))
    except BaseException as e:  # noqa: BLE001 - reported as an incomplete run.
        status = -1
        sys.stderr.write(f"harness: pytest raised {type(e).__name__}: {e}\n")
    changed = _tampered(snap)
    if rewrite.PYC_TAIL != guard.pyc_tail:
        changed.append("_pytest.assertion.rewrite.PYC_TAIL")
    if (guard.files, {p: dict(k) for p, k in guard.defs.items()}, guard.report) != config:
        changed.append("the assertion guard's configuration")
    emit({"when": "end", "exitstatus": status, "records": emitted(),
          "changed": changed[:20], "late_plugins": reporter.late_plugins[:20],
          "agent_plugins": reporter.agent_plugins[:20],
          "inspections": guard.inspections, "refused": guard.refused})  # fmt: skip
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    if not sys.flags.safe_path:
        sys.stderr.write("harness: start it with `python -P` (Python 3.11 or later).\n")
        sys.exit(2)
    main(sys.argv[1:])
