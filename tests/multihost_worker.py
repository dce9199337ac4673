"""One process of a multi-process run for `test_multihost.py`.

    python tests/multihost_worker.py WORKDIR DEVICES [COORDINATOR NUM_PROCESSES PROCESS_ID]
        [--config.FIELD=VALUE ...]

Gives JAX `DEVICES` CPU devices, starts its distributed runtime when a coordinator is named,
and runs `bpo_jax.train.train_and_evaluate` on the tiny ALFWorld config with the overrides.
"""

import sys

import jax


def main(argv):
    workdir, devices, rest = argv[0], int(argv[1]), argv[2:]
    positional = [a for a in rest if not a.startswith("--")]
    overrides = [a[len("--config.") :] for a in rest if a.startswith("--config.")]
    # Global switches before any other JAX call (as bpo_jax.main does).
    jax.config.update("jax_num_cpu_devices", devices)
    from bpo_jax import experiment, train  # noqa: F401 (experiment: config)
    from bpo_jax.parallel import distributed  # noqa: F401 (experiment: config)

    if positional:
        address, num, pid = positional
        distributed.initialize(address, int(num), int(pid))
    import importlib.util

    spec = importlib.util.spec_from_file_location("alfworld_config", "experiments/alfworld.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("cpu,algo=bpo")
    for item in overrides:
        key, value = item.split("=", 1)
        *path, field = key.split(".")
        section = config
        for p in path:
            section = section[p]
        old = section[field] if field in section else None
        section[field] = (
            type(old)(value)
            if old is not None and not isinstance(old, bool)
            else (value == "True" if isinstance(old, bool) else int(value))
        )
    summary = train.train_and_evaluate(config, workdir)
    print("SUMMARY", summary["success_after_rl"], summary["iterations"], flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
