r"""Launcher: `python -m bpo_jax.main --config=experiments/alfworld.py:cpu --workdir=runs/x`.

Intentionally tiny: flags and global switches here, the logic in `bpo_jax.train`, which the
tests import too. Multi-host (TPU VM slices): every host runs this same command; JAX's runtime
is initialised from the TPU environment when `--multihost` is set (see launch_tpu.sh); elsewhere
(CPUs, clusters without auto-detection) name the coordinator and this process:

  python -m bpo_jax.main ... --coordinator_address=10.0.0.1:1234 --num_processes=2 --process_id=0

A mistake in the flags or the config (a bad value, an unknown field, no such experiment file)
ends in one line naming it and exit status 2 (`bpo_jax.cli`; BPO_TRACEBACK=1 shows the
traceback). On a machine without TPUs JAX starts without probing for them
(`bpo_jax.parallel.platforms`), so libtpu, when installed, prints nothing.
"""

import logging

import jax
from absl import flags
from absl import logging as absl_logging

from bpo_jax import cli, report, train
from bpo_jax.config import validate
from bpo_jax.experiment import define_config_flag, unknown_field
from bpo_jax.parallel import distributed, platforms

FLAGS = flags.FLAGS
PROG = "python -m bpo_jax.main"
define_config_flag()
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and the summary.")
flags.DEFINE_bool(
    "multihost", False, "Start JAX's distributed runtime, detecting the cluster (TPU VM slices)."
)
flags.DEFINE_string(
    "coordinator_address", None, "HOST:PORT of process 0 (multi-process without auto-detection)."
)
flags.DEFINE_integer("num_processes", None, "Number of processes (with --coordinator_address).")
flags.DEFINE_integer("process_id", None, "This process's index (with --coordinator_address).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments {argv[1:]}; flags are --name=value", PROG)
    with cli.start_up_errors(PROG):
        validate(FLAGS.config)  # train_and_evaluate validates it again: cheap, and no I/O.
    platforms.quiet_start()  # Before anything touches a device.
    distributed.initialize(
        FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id, auto=FLAGS.multihost
    )
    # Our progress at INFO; libraries (Orbax logs every checkpoint operation) at WARNING.
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger("bpo_jax").setLevel(logging.INFO)
    logging.getLogger("envs").setLevel(logging.INFO)
    logging.getLogger("bpo_jax").info(
        "JAX %s on %d %s device(s), process %d of %d",
        jax.__version__,
        jax.device_count(),
        jax.default_backend(),
        jax.process_index(),
        jax.process_count(),
    )
    summary = train.train_and_evaluate(FLAGS.config, FLAGS.workdir)
    # Success before and after RL with their intervals, RL's effect and compute, the figure.
    print("\n".join(report.final_lines(summary)), flush=True)


if __name__ == "__main__":
    cli.run(main, PROG, explain=unknown_field)
