"""What every experiment file shares: its `:arg` variants and the config sections but `env`.

An experiment file (experiments/*.py, loaded by path by the `--config` flag of
`define_config_flag`) calls `parse_variants(arg)`, then `base_config(variants, ...)`, then sets
`c.env` and overrides, with a comment saying why, the fields its environment needs differently.
Only ml_collections and absl's flags (and the rules table of `bpo_jax.models.axes`, which
imports nothing) are imported here, so that loading a config stays fast and needs no
accelerator.
"""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import ml_collections
from absl import flags
from ml_collections import config_flags

from bpo_jax.models import axes

VARIANTS = ("cpu", "algo", "model")
# Presets whose pretrained weights (and tokenizer and chat template) a `model=` variant loads
# from a GGUF file by name (bpo_jax/io/gguf_file.py: an installed package ships it), so the run
# needs no checkpoint flag and no network.
GGUF_WEIGHTS = {"smollm2_135m": "smollm2_135m_instruct"}
EXPERIMENTS_DIR = Path(__file__).resolve().parents[1] / "experiments"


def parse_variants(arg: str | None, known: Sequence[str] = VARIANTS) -> dict[str, str]:
    """Parses the `:arg` string of `--config=experiments/x.py:arg` into variants.

    Args:
      arg: comma-separated `name` or `name=value` items, e.g. 'cpu,algo=grpo'; None or '' is
        the full (paper) setting.
      known: the variant names the experiment accepts.

    Returns:
      The variants, e.g. {'cpu': 'true', 'algo': 'grpo'}; a bare name maps to 'true'.

    Raises:
      ValueError: a variant not in `known`.
    """
    out = {}
    for item in (arg or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, _, value = item.partition("=")
        out[key.strip()] = value.strip() if value else "true"
    unknown = sorted(set(out) - set(known))
    if unknown:
        raise ValueError(
            f"Unknown variant(s) {unknown} in {arg!r}; known: {', '.join(known)} "
            "(comma-separated, e.g. 'cpu,algo=grpo')."
        )
    return out


def base_config(
    variants: dict[str, str], *, max_prompt_tokens: int, max_action_tokens: int, eval_tasks: int
) -> ml_collections.ConfigDict:
    """Every config section but `env`, for the `cpu` (tiny, local) or the full setting.

    Args:
      variants: from `parse_variants`: `cpu` shrinks everything for a local run, `algo` and
        `model` pick the RL algorithm and the policy preset.
      max_prompt_tokens: `agent.max_prompt_tokens`, the longest prompt: it depends on how long
        the environment's observations are.
      max_action_tokens: `agent.max_action_tokens`, the longest generated action: it depends on
        the environment's action grammar.
      eval_tasks: `eval.num_tasks`, the greedy evaluation episodes: the size of the environment's
        evaluation split (cpu: its training tasks).

    Returns:
      A ConfigDict with seed, model, mesh, agent, sampler, bc, train, rollout, eval, checkpoint
      and log_every; the experiment adds `env`.
    """
    cpu = variants.get("cpu") == "true"

    c = ml_collections.ConfigDict()
    c.seed = 0  # Seeds parameter init, task order and sampling.

    # Policy. `preset` names an architecture in bpo_jax.models.config.PRESETS; `hf_checkpoint`
    # (a directory with config.json, *.safetensors and tokenizer.json) loads pretrained weights.
    c.model = ml_collections.ConfigDict()
    c.model.preset = variants.get("model", "tiny" if cpu else "qwen2_5_7b")
    c.model.hf_checkpoint = ""  # Required for the 7B/8B presets; empty = random init (tiny, small).
    c.model.tokenizer = ""  # Path to a tokenizer; empty = the checkpoint's, or train one (tiny).
    # A GGUF file instead of hf_checkpoint (weights, tokenizer, chat template): a .gguf path or
    # a known name; model=smollm2_135m sets it.
    c.model.gguf = GGUF_WEIGHTS.get(c.model.preset, "")
    c.model.tokenizer_vocab_size = 1024  # SentencePiece vocabulary trained for the tiny policy.
    # Its digits one piece each (False: frequent numbers with their space, " 3", are pieces, so
    # an ALFWorld name like "drawer 3" is two tokens instead of three).
    c.model.tokenizer_split_digits = True
    c.model.max_seq_len = 512 if cpu else 8192  # KV-cache capacity and longest training sequence.
    c.model.dtype = "float32" if cpu else "bfloat16"  # Activation dtype.
    c.model.param_dtype = "float32"  # Parameter (and optimizer-state) dtype.
    # Rematerialisation of each decoder layer in the update's backward pass: none | full |
    # dots_saveable | dots_with_no_batch_dims_saveable (jax.checkpoint_policies). "full" keeps
    # one [B, T, D] residual per layer; without it a 7B update at 4k tokens cannot fit a chip.
    c.model.remat = "none" if cpu else "full"
    # The update runs the layers as one lax.scan over their stacked parameters: XLA compiles
    # one layer, not 28 or 32 (parameters stay stored per layer).
    c.model.scan_layers = not cpu
    # Low-rank adapters (bpo_jax/models/lora.py): rank 0 trains every weight; rank > 0 trains
    # only adapters on `targets` (scale alpha / rank) over a base frozen in model.dtype.
    c.model.lora = ml_collections.ConfigDict()
    c.model.lora.rank = 0
    c.model.lora.alpha = 32.0
    c.model.lora.targets = ("q", "k", "v", "o", "gate", "up", "down")
    c.model.lora.dropout = 0.0  # Must be 0 (not implemented).

    # Device mesh (data, fsdp, tensor); -1 takes the remaining devices. Logical-axis rules map the
    # model's named axes to mesh axes (see bpo_jax/models/sharding.py). With data > 1 the sampler
    # decodes each data-parallel replica's rows as its own program, with no communication in the
    # decode loop (see bpo_jax/sampler/); a batch that data does not divide is one program.
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1
    c.mesh.rules = axes.DEFAULT_RULES  # Override with a tuple of (logical axis, mesh axes).
    # Shares each batch of tasks is cut into for the hosts (0 = one per process); results
    # depend on the number of shares, not of processes (`bpo_jax.multihost.shares`).
    c.mesh.task_shards = 0
    # Multislice (several TPU slices over DCN): the data axis spans the slices, `dcn_data` of
    # them (0: all the devices span); data, fsdp and tensor above are sizes within one slice.
    c.mesh.dcn_data = 0
    # Where a multi-host run samples: "host" (each host on its own chips, with a copy of the
    # parameters) or "slice" (programs over the whole mesh, the hosts in lockstep; needs
    # sampler.prefix_reuse=False). TPU v5e / v6e slices refuse one host's programs: use "slice".
    c.mesh.sampler = "host"

    # Agent turn format (bpo_jax/agent/): task + first observation + the last `history_turns`
    # (observation, action) pairs + the current observation; the action is parsed from the
    # generated text. "tiny": tagged text the tiny policy learns by cloning; "chat": the
    # checkpoint's chat template, an instruction per environment, reasoning then
    # <action>...</action> (instruct models; the full settings set it with verl-agent's lengths).
    c.agent = ml_collections.ConfigDict()
    c.agent.format = "tiny"
    c.agent.history_turns = 2
    c.agent.max_prompt_tokens = max_prompt_tokens  # Longest prompt; the oldest turns drop first.
    c.agent.max_action_tokens = max_action_tokens  # Longest generated action.
    # tiny only: a <notes> section, the environment's summary of the texts seen so far
    # (ALFWorld: where the agent is, what it holds and saw, what it has not visited).
    c.agent.notes = False

    # Sampling during rollouts (evaluation is greedy).
    c.sampler = ml_collections.ConfigDict()
    # The RL policy is softmax(logits / temperature): the learner scores tokens at the same
    # temperature. The tiny BC policy is too uncertain at 1.0 to finish many tasks.
    c.sampler.temperature = 0.5 if cpu else 1.0
    c.sampler.top_p = 1.0
    c.sampler.length_bucket = 64
    # Each turn's prompts continue the previous turn's contexts (bpo_jax/sampler/prefixes.py).
    c.sampler.prefix_reuse = True
    # Prompt columns a prefill runs at a time (0: all; a multiple of length_bucket). Bounds the
    # prefill's activations: `python -m bpo_jax.compile` says which chunk fits a slice.
    c.sampler.prefill_chunk = 0

    # Behaviour cloning from expert demos (starts the tiny policy; off for 7B/8B).
    c.bc = ml_collections.ConfigDict()
    c.bc.steps = 150 if cpu else 0
    c.bc.batch_size = 16
    c.bc.lr = 2e-3
    # walkthrough: the games' own expert plans (the planner knows where everything is) |
    # search: the environment's searching demonstrator, which decides from the observations
    # only (ALFWorld; needs a longer env.max_steps to finish: docs/start_policy.md).
    c.bc.demos = "walkthrough"
    # Share of demo steps also cloned after 1-2 commands the game cannot execute ("Nothing
    # happens."), labelled with the expert's action there: a cloned policy sees how to go on
    # from its own mistakes instead of only from the expert's states (0 = off).
    c.bc.recovery = 0.0

    # RL.
    c.train = ml_collections.ConfigDict()
    # bpo | treerl (trees) | grpo | rloo | gigpo | ppo (independent groups): bpo_jax/algorithms.py.
    # BPO by default: its trees spend the baselines' measured per-task compute (spend / budget
    # 0.91-1.10 per batch on ALFWorld, bench/results/branch_rules_k0_3.json); `algo=grpo` etc.
    # give the baselines at the same budget.
    c.train.algo = variants.get("algo", "bpo")
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
    # Sequences per microbatch of the gradient (accumulated in float32 inside the jitted step;
    # the update equals the whole minibatch's); 0 = the whole minibatch at once. Full setting:
    # as many rows as the mesh splits the batch into at most (one row per chip on 64 chips).
    c.train.microbatch_size = 0 if cpu else 64
    # Positions per chunk of the LM head when the update scores tokens: the [B, L, V] float32
    # logits never exist whole (at a 152k vocabulary a 4k-token row's are 2.5 GB); 0 = all.
    c.train.logits_chunk = 0 if cpu else 512
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
    # Rows with A = 0 skip the update's passes (the same step up to rounding; not with a KL).
    c.train.skip_zero_advantage = True

    # Rollout topology of the tree algorithms (bpo, treerl); independent algorithms (grpo, rloo,
    # gigpo, ppo) play `train.group_size` forks of each task's reset. See
    # bpo_jax/rollout/branching.py.
    c.rollout = ml_collections.ConfigDict()
    # K0 backbones per task (>= 2: the first steps need siblings). CPU: 3 against group_size 4,
    # the tree that lost least to RLOO on the tabular MDPs' variance map (docs/variance_map.md).
    c.rollout.root_group = 3 if cpu else 2
    c.rollout.num_branches = 2 if cpu else 4  # K children per branch point (backbone + K - 1).
    c.rollout.branch_budget = 2 if cpu else 4  # Branch points per backbone (its whole subtree).
    c.rollout.max_depth = 2  # Nested branch points on a root-to-leaf path.
    # entropy | action_samples | uniform | interval | posthoc_topk (biased).
    c.rollout.selector = "entropy"
    c.rollout.entropy_quantile = 0.75  # Branch at or above this running quantile of entropies.
    c.rollout.entropy_window = 512  # Recent action entropies the quantile is taken over.
    c.rollout.entropy_reduce = "first"  # first (unbiased) | mean | max (ablations).
    c.rollout.branch_prob = 0.2  # selector=uniform: branch probability per step.
    c.rollout.interval = 3  # selector=interval: branch every this many steps.
    # selector=action_samples: extra actions sampled at h_t (their tokens count in the budget);
    # a step is a candidate where their parsed actions disagree.
    c.rollout.probe_samples = 4
    # selector=action_samples: the share of a task's slack (budget - committed) its probes may
    # spend; each eligible step probes with the probability that spreads it over the task's
    # expected remaining steps (1: probe every step the slack pays for, leaving little to branch).
    c.rollout.probe_share = 0.5
    # Per-task compute budget of the tree algorithms; 0 = auto: `group_size` times the measured
    # cost of an independent episode at the current parameters (the mean over recent backbone
    # episodes: a backbone's own path from the reset is one), so BPO spends what the baselines
    # spend.
    c.rollout.budget = 0.0
    c.rollout.budget_unit = "tokens"  # tokens (generated) | env_steps.
    # With budget=0, each task's budget is group_size episodes of that task, measured on its
    # own backbones while they play (task), or of earlier batches' mean episode (batch).
    c.rollout.budget_reference = "task"
    # target: a branch that only partly fits the budget is taken with probability (what fits) /
    # (its cost), so trees spend the budget on average; cap: never exceed it (under-spends).
    c.rollout.budget_mode = "target"
    # After each batch the branch rule's rate (entropy quantile, uniform probability) moves by
    # gain * (spend/budget - 1), towards spending the budget; 0 keeps the configured rate.
    c.rollout.rate_gain = 0.1
    # threshold: a path is a candidate when the rule's own test passes; spread: when its score
    # ranks in the top b / R(t) of recent scores at its step (b branch points left, R(t) expected
    # steps left), so each backbone spreads its branch points over its episode.
    c.rollout.branch_schedule = "threshold"
    c.rollout.entropy_per_step = False  # selector=entropy: quantile among entropies at step t.
    # The batch's tasks play in this many cohorts whose turns are pipelined: one cohort samples
    # on the accelerator while the others' environment steps run in the sandbox workers
    # (`bpo_jax.rollout.engine`; at most one cohort per task, 1 = plain lockstep). 2 is enough to
    # hide
    # whichever of sampling and env steps is the shorter; more cohorts make each sampling call
    # smaller (less batching on the accelerator) for little more overlap.
    c.rollout.overlap_cohorts = 2
    # fixed: the tree above | auto: each batch's shape (K0, K, the steps it branches at) is the
    # one the first-order variance model predicts least noisy at the budget, from earlier
    # batches' measurements only (bpo_jax/rollout/design.py); the tree above is its prior,
    # played first and every `auto_explore` batches (0: first only) to keep measuring f.
    c.rollout.tree = "fixed"
    c.rollout.auto_explore = 4
    # selector=steps: branch every path at these steps ("3", "2,6"): a fixed design, e.g. the one
    # a pilot chose (`python -m bpo_jax.study.pilot`); set K0, K, branch_budget and max_depth
    # with it (`rollout.design.Design.spec_fields`).
    c.rollout.branch_steps = ""

    # Evaluation: greedy episodes before RL (after BC) and at the end.
    c.eval = ml_collections.ConfigDict()
    c.eval.num_tasks = eval_tasks  # Evaluation tasks (the first of the shuffled eval split).
    c.eval.every = 0  # Also evaluate every N iterations (0 = only before and after).
    c.eval.sampled = False  # Also one sampled episode per task (at sampler.temperature).
    c.eval.initial = True  # Also evaluate the policy before behaviour cloning.
    # Evaluation results shared between runs ('' = none; a sweep sets its own): an evaluation
    # of exactly the same episodes (parameters, games, keys, settings) is reused, not replayed.
    c.eval.cache_dir = ""

    # Checkpoints (Orbax) in <workdir>/checkpoints; a restarted run resumes from the latest.
    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 2 if cpu else 5
    c.checkpoint.max_to_keep = 2

    c.log_every = 1  # Write behaviour-cloning metrics every N steps.
    # A finished run's workdir: RL starts from its latest checkpoint's policy and tokenizer
    # instead of behaviour cloning, so every algorithm of a seed starts from the same policy.
    c.init_from = ""
    if c.model.gguf:
        _pretrained_instruct(c)
    return c


def _pretrained_instruct(c: ml_collections.ConfigDict) -> None:
    """What a pretrained instruct policy changes: it acts in its chat template from the start.

    No behaviour cloning (the walkthroughs hold bare actions, not the reasoning a chat answer
    starts with), so the initial policy is the one "before RL" evaluates: no separate initial
    evaluation. Sampling at temperature 1 and verl-agent's learning rate, as for the 7B/8B
    policies. The experiment file sets the chat lengths (`bpo_jax.agent.presets`). Float32 on
    a CPU (`cpu`), as the weights were dequantized; bfloat16 with
    `--config.model.dtype=bfloat16 --config.model.param_dtype=bfloat16`.
    """
    c.agent.format = "chat"
    c.bc.steps = 0
    c.eval.initial = False
    c.sampler.temperature = 1.0
    c.train.lr = 1e-6


def load_experiment(path: str | Path) -> ModuleType:
    """Imports an experiment file by path, as config_flags does (tests, scripts)."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"experiment_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _ExperimentFileParser(flags.ArgumentParser):
    """The parser of `--config=PATH[:ARG]` in place of config_flags' own: PATH is imported by
    `load_experiment` (ml_collections 1.1 imports it by the deprecated
    `SourceFileLoader.load_module`, a DeprecationWarning each time), and a missing file fails at
    once, naming it (config_flags defers that error to the config's first use, where it shows
    as two chained tracebacks)."""

    def __init__(self, lock_config: bool = True):
        self._lock_config = lock_config
        self.loaded = None  # The last config loaded, before any override.

    def flag_type(self) -> str:
        return "config object"

    def parse(self, path):
        file, sep, arg = path.partition(":")
        if not Path(file).is_file():
            known = ", ".join(f"experiments/{p.name}" for p in sorted(EXPERIMENTS_DIR.glob("*.py")))
            raise ValueError(f"no experiment file {file!r} here ({Path.cwd()}); known: {known}")
        config = load_experiment(file).get_config(*([arg] if sep else []))
        self.loaded = config
        if self._lock_config:
            config.lock()
        return config


def define_config_flag(
    flag_values: flags.FlagValues = flags.FLAGS,
    *,
    name: str = "config",
    help_string: str = "Experiment config file, PATH[:variants].",
    sys_argv: Sequence[str] | None = None,
) -> flags.FlagHolder:
    """`--config=experiments/x.py[:variants]` with `--config.section.field=value` overrides.

    config_flags' `DEFINE_config_file` (locked: an override of a field the experiment does not
    have fails), whose file is imported by `load_experiment`.

    Args:
      flag_values: the FlagValues to define it in.
      name: the flag's name.
      help_string: its help.
      sys_argv: the command line its overrides are read from (default: `sys.argv` at parse).

    Returns:
      The flag's holder; `flag_values[name].value` is the ConfigDict once parsed.
    """
    holder = config_flags.DEFINE_config_file(
        name, None, help_string, flag_values=flag_values, lock_config=True, sys_argv=sys_argv
    )
    flag_values[name].parser = _ExperimentFileParser(lock_config=True)
    return holder


def unknown_field(flag_values: flags.FlagValues, argv: Sequence[str], name: str = "config"):
    """The first `--config.a.b=...` in `argv` naming a field the loaded config lacks, as one
    line (with the closest fields), or None; for the message of a failed override."""
    parser = flag_values[name].parser
    config = getattr(parser, "loaded", None)
    if config is None:
        return None
    prefix = f"--{name}."
    for item in argv:
        if not item.startswith(prefix):
            continue
        path = item[len(prefix) :].partition("=")[0]
        node, where = config, name
        for key in path.split("."):
            if not isinstance(node, ml_collections.ConfigDict):
                return f"{item}: {where} is not a section (it has no field {key!r})"
            if key not in node:
                close = difflib.get_close_matches(key, list(node.keys()), n=3)
                hint = f"did you mean {' or '.join(map(repr, close))}?" if close else ""
                hint = hint or f"its fields: {', '.join(sorted(node.keys()))}"
                return f"{item}: {where} has no field {key!r}; {hint}"
            node, where = node[key], f"{where}.{key}"
    return None
