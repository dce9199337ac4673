r"""Repository repair (SWE-bench schema): GRPO, RLOO, BPO, ... on bugs in real Python packages.

Paper setting (Qwen2.5-7B, 16 tasks x 8 rollouts, 30 steps) on SWE-bench Verified, which runs in
the instances' Docker images (a machine with Docker; see envs/swe/docker.py):

  python -m bpo_jax.main --config=experiments/swebench.py \
      --config.env.data_root=/data/swebench_verified.jsonl \
      --config.model.hf_checkpoint=/path/to/Qwen2.5-7B-Instruct --workdir=gs://bucket/swebench

Local CPU default (a tiny policy, behaviour cloning from the walkthroughs, then GRPO) on the
synthetic tasks (bugs injected into PyPI packages, graded by their own test suites). Build them
once (a few minutes; downloads the packages with pip), then train:

  python -m envs.swe.build --out ~/.cache/bpo_jax/swe
  python -m bpo_jax.main --config=experiments/swebench.py:cpu --workdir=runs/swebench_cpu

Variants are comma-separated in the `:arg` string: `cpu`, `algo=<name>`, `model=<preset>`,
e.g. `--config=experiments/swebench.py:cpu,algo=bpo`. Any field can be overridden on the
command line, e.g. `--config.env.task_options.source=synthetic`.
"""

import ml_collections


def parse_arg(arg: str | None) -> dict[str, str]:
    """Parses 'cpu,algo=grpo' into {'cpu': 'true', 'algo': 'grpo'}."""
    out = {}
    for item in (arg or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, _, value = item.partition("=")
        out[key.strip()] = value.strip() if value else "true"
    return out


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variants = parse_arg(arg)
    unknown = set(variants) - {"cpu", "algo", "model"}
    if unknown:
        raise ValueError(
            f"Unknown variant(s) {sorted(unknown)} in {arg!r}; known: cpu, algo=, model=."
        )
    cpu = variants.get("cpu") == "true"

    c = ml_collections.ConfigDict()
    c.seed = 0  # Seeds parameter init, task order and sampling.

    # Policy. `preset` names an architecture in bpo_jax.models.config.PRESETS; `hf_checkpoint`
    # (a directory with config.json, *.safetensors and tokenizer.json) loads pretrained weights.
    c.model = ml_collections.ConfigDict()
    c.model.preset = variants.get("model", "tiny" if cpu else "qwen2_5_7b")
    c.model.hf_checkpoint = ""  # Required for the 7B/8B presets; empty = random init (tiny only).
    c.model.tokenizer = ""  # Path to a tokenizer; empty = the checkpoint's, or train one (tiny).
    c.model.tokenizer_vocab_size = 1024  # SentencePiece vocabulary trained for the tiny policy.
    c.model.max_seq_len = 512 if cpu else 8192  # KV-cache capacity and longest training sequence.
    c.model.dtype = "float32" if cpu else "bfloat16"  # Activation dtype.
    c.model.param_dtype = "float32"  # Parameter (and optimizer-state) dtype.

    # Device mesh (data, fsdp, tensor); -1 takes the remaining devices. Logical-axis rules map the
    # model's named axes to mesh axes (see bpo_jax/models/sharding.py).
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1
    c.mesh.rules = (
        ("batch", ("data", "fsdp")),
        ("length", None),
        ("embed", "fsdp"),
        ("heads", "tensor"),
        ("kv_heads", "tensor"),
        ("head_dim", None),
        ("mlp", "tensor"),
        ("vocab", "tensor"),
        ("layers", None),
    )

    # Environment: envs/swe. Tasks are SWE-bench-schema instances; the agent acts with the tool
    # grammar of envs/swe/tools.py; reward 1 when every FAIL_TO_PASS and PASS_TO_PASS test passes.
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

    # Agent turn format: task (the goal line) + the first observation (the problem statement and
    # the tool list) + the last `history_turns` (observation, action) pairs + the current
    # observation; the action is the generated text up to its first newline.
    c.agent = ml_collections.ConfigDict()
    c.agent.history_turns = 2
    c.agent.max_prompt_tokens = 384 if cpu else 7168
    c.agent.max_action_tokens = 48 if cpu else 256  # `replace PATH:LINE OLD => NEW` is long.

    # Sampling during rollouts (evaluation is greedy).
    c.sampler = ml_collections.ConfigDict()
    # The RL policy is softmax(logits / temperature): the learner scores tokens at the same
    # temperature. The tiny BC policy is too uncertain at 1.0 to ever finish a task.
    c.sampler.temperature = 0.5 if cpu else 1.0
    c.sampler.top_p = 1.0
    c.sampler.length_bucket = 64

    # Behaviour cloning from the expert walkthroughs (view the buggy lines, apply the gold fix
    # with `replace`, submit; starts the tiny policy; off for 7B/8B).
    c.bc = ml_collections.ConfigDict()
    c.bc.steps = 150 if cpu else 0
    c.bc.batch_size = 16
    c.bc.lr = 2e-3

    # RL.
    c.train = ml_collections.ConfigDict()
    # grpo | rloo | gigpo | ppo (independent groups) | bpo | treerl (trees); see config.ALGOS.
    c.train.algo = variants.get("algo", "grpo")
    c.train.iterations = 6 if cpu else 50  # Policy-update iterations (one rollout batch each).
    c.train.tasks_per_iter = 4 if cpu else 16
    c.train.group_size = 4 if cpu else 8  # Rollouts per task (forks of one reset).
    c.train.lr = 5e-5 if cpu else 1e-6
    c.train.weight_decay = 0.0
    c.train.b1 = 0.9
    c.train.b2 = 0.999
    c.train.grad_clip = 1.0  # Global-norm clipping; 0 disables.
    c.train.clip_eps = 0.2  # PPO-style ratio clipping.
    c.train.kl_coef = 0.0  # KL(pi || reference) penalty (k3 estimator); 0 = no reference model.
    c.train.epochs = 1  # Passes over each rollout batch.
    c.train.minibatch_size = 64 if cpu else 128  # Sequences per gradient step.
    c.train.loss_agg = "token_mean"  # token_mean | seq_mean.
    # Loss weight of a step. "trajectory": every root-to-leaf path counts once with weight
    # (its probability in the tree) / (its length), the per-trajectory objective GRPO and RLOO
    # estimate; "path_mass": the probability of the paths through the step, unnormalised by
    # length; "uniform": 1 per step (ablation: long failing episodes and the steps after branch
    # points dominate).
    c.train.step_weighting = "trajectory"
    c.train.adv_eps = 1e-6
    c.train.normalize = "none"  # none | sibling_std: divide bpo/rloo advantages by sibling std.
    c.train.gamma = 1.0  # PPO: discount over turns.
    c.train.gae_lambda = 0.95  # PPO: GAE lambda over turns.
    c.train.value_lr = 1e-3  # PPO: Adam learning rate of the value head.
    c.train.value_epochs = 4  # PPO: value-head passes over each rollout batch.

    # Rollout topology of the tree algorithms (bpo, treerl); independent algorithms (grpo, rloo,
    # gigpo, ppo) play `train.group_size` forks of each task's reset. See bpo_jax/branching.py.
    c.rollout = ml_collections.ConfigDict()
    c.rollout.root_group = 2  # K0 backbones per task (>= 2: the first steps need siblings).
    c.rollout.num_branches = 2 if cpu else 4  # K children per branch point (backbone + K - 1).
    c.rollout.branch_budget = 2 if cpu else 4  # Branch points per backbone (its whole subtree).
    c.rollout.max_depth = 2  # Nested branch points on a root-to-leaf path.
    c.rollout.selector = "entropy"  # entropy | uniform | interval | posthoc_topk (biased).
    c.rollout.entropy_quantile = 0.75  # Branch at or above this running quantile of entropies.
    c.rollout.entropy_window = 512  # Recent action entropies the quantile is taken over.
    c.rollout.entropy_reduce = "first"  # first (unbiased) | mean | max (ablations).
    c.rollout.branch_prob = 0.2  # selector=uniform: branch probability per step.
    c.rollout.interval = 3  # selector=interval: branch every this many steps.
    # Per-task compute budget of every algorithm's rollouts; 0 = auto: what `group_size`
    # independent episodes are expected to cost (running mean episode length x tokens per
    # action, from earlier batches), so BPO and the baselines match compute.
    c.rollout.budget = 0.0
    c.rollout.budget_unit = "tokens"  # tokens (generated) | env_steps.

    # Evaluation: greedy episodes before RL (after BC) and at the end.
    c.eval = ml_collections.ConfigDict()
    c.eval.num_tasks = 16 if cpu else 100
    c.eval.every = 0  # Also evaluate every N iterations (0 = only before and after).

    # Checkpoints (Orbax) in <workdir>/checkpoints; a restarted run resumes from the latest.
    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 2 if cpu else 5
    c.checkpoint.max_to_keep = 2

    c.log_every = 1
    return c
