"""The command lines' start-up: a mistake in the arguments is one line and exit status 2, and a
machine without TPUs starts JAX without libtpu's discovery messages.

Each bad input runs as the user would run it, a subprocess of `python -m ...`; they all fail
before any environment or model is built (seconds each).
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from libtpu_fixtures import require_libtpu

from bpo_jax import cli
from bpo_jax.algorithms import ALGORITHMS
from bpo_jax.parallel import platforms

ROOT = Path(__file__).resolve().parents[1]
CPU = "--config=experiments/alfworld.py:cpu"
ALGOS = str(sorted(ALGORITHMS))  # As the config check lists them.


def _run(*args: str, env=None) -> subprocess.CompletedProcess:
    """`python -m ARGS` from the repository root, without a traceback switch unless `env` sets
    one."""
    env = {k: v for k, v in os.environ.items() if k != cli.TRACEBACK_ENV} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )


def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The failure's only line (stdout empty, no traceback), after `prog: error: `."""
    assert proc.returncode == cli.EXIT_USAGE, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stdout == ""
    prog, _, message = lines[0].partition(": error: ")
    assert prog.startswith("python -m bpo_jax") and message, lines[0]
    return message


@pytest.mark.parametrize(
    "args, expected",
    [
        # A value outside its allowed set names the field, the value and the choices.
        ((CPU, "--config.train.algo=bpoo"), f"train.algo must be one of {ALGOS}, got 'bpoo'"),
        ((CPU, "--config.train.lr=-1"), "config.train.lr must be > 0, got -1.0"),
        # An unknown field keeps its "did you mean".
        ((CPU, "--config.train.algoo=bpo"), "train has no field 'algoo'; did you mean 'algo'?"),
        ((CPU, "--config.train.lr=abc"), "--config.train.lr=abc: could not convert string"),
        (("--config=experiments/nope.py:cpu",), "no experiment file 'experiments/nope.py'"),
        (("--config=experiments/alfworld.py:cpu,turbo",), "Unknown variant(s) ['turbo']"),
    ],
)  # fmt: skip
def test_main_job_config_mistakes_are_one_line(args, expected):
    proc = _run("bpo_jax.main", "--workdir=/tmp/never_written", *args)
    assert expected in _one_line_error(proc)
    assert not Path("/tmp/never_written").exists()


def test_the_traceback_is_one_switch_away():
    proc = _run(
        "bpo_jax.main",
        CPU,
        "--workdir=/tmp/never_written",
        "--config.train.algo=bpoo",
        env={cli.TRACEBACK_ENV: "1"},
    )
    assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.strip().endswith(f"must be one of {ALGOS}, got 'bpoo'.")


def test_sweep_mistakes_are_one_line(tmp_path):
    sweep = tmp_path / "sweep.py"
    sweep.write_text(
        textwrap.dedent(
            """
            from bpo_jax.study.sweep import Sweep

            def get_sweep():
                return Sweep(config="experiments/alfworld.py:cpu", algos=("bpo",), seeds=(0,),
                             overrides={"train.itrations": 2})
            """
        )
    )
    work = f"--workdir={tmp_path / 'runs'}"
    message = _one_line_error(_run("bpo_jax.study.sweep", f"--sweep={tmp_path}/nope.py", work))
    assert message.startswith(f"--sweep={tmp_path}/nope.py: no such file")
    message = _one_line_error(_run("bpo_jax.study.sweep", f"--sweep={sweep}", work))
    assert "sweep run bpo/seed_0: --config.train.itrations=2: config.train has no field" in message
    assert "did you mean 'iterations'?" in message
    assert not (tmp_path / "runs").exists()


def test_tables_mistakes_are_one_line(tmp_path):
    out = f"--out={tmp_path / 'out'}"
    message = _one_line_error(_run("bpo_jax.study.tables", "--runs=/nonexistent/runs", out))
    assert message.startswith("--runs=/nonexistent/runs: no such folder")
    message = _one_line_error(
        _run("bpo_jax.study.tables", "--runs=results/alfworld_cpu", out, "--reference=bpoo")
    )
    assert message.startswith("--reference=bpoo: no run of that algorithm")
    assert "bpo, grpo, rloo" in message


@pytest.mark.parametrize(
    "flag, expected",
    [
        ("--topology=v9-64", "Unknown TPU accelerator type 'v9-64'"),
        ("--num_slices=0", "--num_slices must be >= 1, got 0"),
        ("--programs=turn", "--programs: unknown ['turn']"),
        ("--json=/nonexistent/report.json", "--json=/nonexistent/report.json: its folder"),
    ],
)
def test_compile_tool_mistakes_are_one_line(flag, expected):
    assert expected in _one_line_error(_run("bpo_jax.compile", CPU, flag))


def test_traceback_switches():
    assert not cli.wants_traceback(["main", "--workdir=x"], environ={})
    assert cli.wants_traceback(["main"], environ={cli.TRACEBACK_ENV: "1"})
    assert not cli.wants_traceback(["main"], environ={cli.TRACEBACK_ENV: "0"})
    assert cli.wants_traceback(["main", "--verbosity=1"], environ={})
    assert cli.wants_traceback(["main", "-v", "2"], environ={})
    assert not cli.wants_traceback(["main", "--verbosity=0"], environ={})


def _machine(*paths: str, files: dict | None = None):
    """A fake machine's glob and file reader: `paths` exist, `files` hold text."""
    files = files or {}
    present = set(paths) | set(files)

    def exists(pattern: str) -> list[str]:
        import fnmatch

        return sorted(p for p in present if fnmatch.fnmatch(p, pattern))

    return exists, lambda path: files.get(path, "")


def test_platforms_skip_tpu_discovery_only_where_there_is_no_tpu():
    bare = _machine()
    assert platforms.cpu_start_platforms({}, set(), *bare) == "cpu"
    # A TPU VM (its chips' device files or PCI ids), a machine meant for one, or a choice made
    # by the user: JAX's own start.
    assert platforms.cpu_start_platforms({}, set(), *_machine("/dev/accel0")) is None
    assert platforms.cpu_start_platforms({}, set(), *_machine("/dev/vfio/0")) is None
    pci = {"/sys/bus/pci/devices/0000:00:04.0/vendor": "0x1ae0"}
    tpu = {**pci, "/sys/bus/pci/devices/0000:00:04.0/device": "0x0062"}
    nic = {**pci, "/sys/bus/pci/devices/0000:00:04.0/device": "0x0042"}  # gVNIC: not a TPU.
    assert platforms.cpu_start_platforms({}, set(), *_machine(files=tpu)) is None
    assert platforms.cpu_start_platforms({}, set(), *_machine(files=nic)) == "cpu"
    assert platforms.cpu_start_platforms({"TPU_ACCELERATOR_TYPE": "v5p-8"}, set(), *bare) is None
    assert platforms.cpu_start_platforms({"JAX_PLATFORMS": ""}, set(), *bare) is None
    # What importing JAX sets wherever libtpu is installed says nothing about a TPU.
    assert platforms.cpu_start_platforms({"TPU_SKIP_MDS_QUERY": "1"}, set(), *bare) == "cpu"
    # A CUDA plugin keeps CUDA where a GPU is present; an unknown plugin keeps JAX's choice.
    gpu = _machine("/dev/nvidiactl", "/dev/nvidia0")
    assert platforms.cpu_start_platforms({}, {"xla_cuda12"}, *gpu) == "cuda,cpu"
    assert platforms.cpu_start_platforms({}, {"xla_cuda12"}, *bare) == "cpu"
    assert platforms.cpu_start_platforms({}, {"metal"}, *bare) is None


_START = textwrap.dedent(
    """
    import sys
    from bpo_jax.parallel import platforms
    if sys.argv[1] == "quiet":
        print("platforms", platforms.quiet_start(), flush=True)
    import jax
    print("backend", jax.default_backend(), flush=True)
    if sys.argv[1] == "quiet":
        print("-- compile-only devices --", file=sys.stderr, flush=True)
        from bpo_jax import compile as compile_tool
        chips = compile_tool.topology_devices(compile_tool.parse_topology("v5p-16"))
        print("compile-only chips", len(chips), chips[0].platform, flush=True)
    """
)


def test_a_cpu_start_prints_nothing_of_libtpu():
    """With libtpu installed, JAX's first device query on a machine without TPUs starts libtpu,
    which prints its failed discovery; the quiet start does not, and the compile tool's
    compile-only TPU devices still load (libtpu, on their own)."""
    require_libtpu()
    if platforms.has_tpu(os.environ):
        pytest.skip("this machine has TPUs: JAX's own start is kept there")
    # Several processes may load libtpu at once here (its lockfile would make it quiet).
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    env.pop("JAX_PLATFORMS", None)

    def start(mode):
        return subprocess.run(
            [sys.executable, "-c", _START, mode],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )

    quiet = start("quiet")
    assert "platforms cpu" in quiet.stdout and "backend cpu" in quiet.stdout
    assert "compile-only chips 8 tpu" in quiet.stdout
    before_compile = quiet.stderr.split("-- compile-only devices --")[0]
    assert "TPU" not in before_compile and "libtpu" not in before_compile, quiet.stderr
    noisy = start("default")
    if "TPU" not in noisy.stderr:
        pytest.skip("libtpu printed nothing here even unrestricted: nothing to silence")
    assert "backend cpu" in noisy.stdout
