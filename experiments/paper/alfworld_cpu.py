r"""The CPU table: BPO, GRPO and RLOO on ALFWorld's `cpu` variant, 5 paired seeds.

  python -m bpo_jax.study.sweep --sweep=experiments/paper/alfworld_cpu.py
  --workdir=runs/alfworld_cpu \
      --commit_to=results/alfworld_cpu
  python -m bpo_jax.study.tables --runs=results/alfworld_cpu --out=docs/results/alfworld_cpu

WHY THIS CONFIGURATION (written 2026-12-01, before any run of this sweep; never tuned on its
results or on the held-out games):
  - The tree, from the gradient-variance map (`docs/variance_map.md`, the real engine on the
    tabular MDPs at equal measured spend, trajectory weighting): BPO's gradient was noisier than
    RLOO's at 21 of 24 points. With N = 4 the configuration that loses least is K0 = 3, K = 2,
    up to 2 branch points per backbone, max_depth 2: ratio 1.02 (95% CI 0.95-1.09), against
    1.14 (1.07-1.22) at the old K0 = 2; K = 3 gave 1.51 (1.39-1.64), K = 4 1.77 (1.62-1.93), one
    branch point per backbone under-spent (0.875) and three gave 1.27 (1.15-1.39). ALFWorld's
    sparse reward sits at the map's density-0 end, where no point won: these tables are not
    expected to halve the gradient variance, and the probe's measured ratio is what is reported.
  - The branch rule, from `bench/bench_branch_rules.py` on a behaviour-cloned CPU policy
    (training games, 4 batches per rule, the same tasks for every rule): `action_samples`
    branch points had children with different values 0.31 / 0.54 / 0.15 / 0.30 of the time,
    against 0.00 / 0.00 / 0.00 / 0.17 for the first-token entropy rule and 0.00-0.14 with the
    entropy rule under the `spread` schedule, which did not help either rule.
  - The budget: each task's budget is `group_size` = 4 episodes of that task, measured on its
    own backbones as they play (`rollout.budget_reference=task`), in generated tokens, spent as
    a target (`budget_mode=target`); the probe tokens of `action_samples` count in it.
  - Step weighting: the default (`trajectory`), as in the map. With variable episode lengths it
    makes RLOO and the tree estimate different length-normalised objectives (see
    `bpo_jax/estimators/kernels.py`); `path_mass` (the `pathmass` ablation) estimates grad J.

STATUS (2026-12-03, session 15): DONE. bc/shared, seeds 0-4 (bpo, grpo, rloo) and the probe of
the start (PROBE), records in results/alfworld_cpu/, tables in docs/results/alfworld_cpu/, what
they say in docs/results.md (no difference between the three algorithms). The start re-runs
bit for bit only on the kind of CPU that made it (AMD EPYC; not on an Intel Xeon): the sweep
refuses a re-run start that differs from its record (bpo_jax/study/sweep.py). The start policy
was chosen (below) on the 55 development games held out of the training games
(`env.dev_fraction=0.3`), never on the tables' games (docs/start_policy.md):
  - search demos (the demonstrator that reads only the text), recovery examples 0.5, 2 turns of
    history, the agent's notes (`agent.notes`), numbers as one token
    (`model.tokenizer_split_digits=False`), 32 steps, 1,200 BC steps: 6 of 55 dev games greedy
    (95% CI 0.05-0.22), 5 sampled. 2,400 steps fitted the demos better (loss 0.15 against
    0.27 over the last 100 steps) but won 4 of 55 greedy: not chosen (one seed each; the two
    are within noise).
  - what was measured before it, on dev: 0-1 of 55 for every earlier row (split digits, with or
    without notes, 6 turns of history); the policy matched the demonstrator's action at 0.57 of
    the states of its own games with split digits and 0.73 with joined ones.
  `bc/shared` runs it once for every seed (`bc_once`): seeds vary RL, from one start, as one
  pretrained checkpoint starts every seed in the paper's setting. The algorithms of a seed share
  their before-RL evaluation, and the greedy one is shared by every seed (`share_evals`). RL
  trains on the 107 games BC cloned.

TABLE 2 AT A DESIGN THAT CAN WIN (issue 30 item 6; written 2026-12-05, after the pilot and
before any probe of a design):
  - The pilot (`python -m bpo_jax.study.pilot`, README "Pilot"; record in
    results/alfworld_cpu/pilot/shared) re-made bc/shared (its BC loss at step 1,200 equal to the
    record's, 0.31011), then played at its parameters one `bpo` batch per branch step d in
    1, 2, 4, 6, 8, 12, 16 (K0 = N = 4 backbones, every path branching into 2 at d, no budget) on
    16 training tasks the probe does not play (training order 4-19): 431 branch points.
  - What it measured: only 7 of its 109 (batch, task) draws had any return variance (the start
    wins a training game rarely, and almost every episode runs to the 32-step limit: survival
    0.92 at step 31). f per depth is unmeasurable at that spread: 0 to 2 informative tasks per
    depth, pooled f 0.23 (95% CI -0.14 to 0.89). Table 2a on these forests: E[A^2] sibling 0.028
    against trajectory 0.034, reduction 0.006 (-0.006 to 0.020), predicted 0.008.
  - The first-order model (`rollout/design.py`) fitted to that profile at a budget of N = 4
    episodes predicts no tree below RLOO(4): the best, [[0, 2], [10, 2], [26, 2]], at 1.02, and
    K0 = 3 with K = 2 at 1.03-1.24 (branching at step 12 to 2); `choose_design` falls back to
    independent groups (K0 = N). So no design with a predicted win exists at this start, and the
    powered design probe is not run at it: a probe sized to exclude 1 needs a predicted ratio
    below 1. What would change it: a start whose returns vary within a task (more wins), or a
    pilot over many more tasks (`pilot/wide`: 48 other training tasks at d = 2, 6, 12, running;
    resumable). Both pilots take the probe's flags (`--dry_run` prints them) with
    `-m bpo_jax.study.pilot --workdir=<sweep>/pilot/<name> --reference_probe=
    results/alfworld_cpu/probe/shared/probe.json` and, for `shared`, `--depths=1,2,4,6,8,12,16
    --tasks=16 --first_task=4`; for `wide`, `--depths=2,6,12 --tasks=48 --first_task=20`.

  - `pilot/wide` (added 2026-12-05 after it finished; record in results/alfworld_cpu/pilot/wide):
    48 other training tasks (order 20-67) at d = 2, 6, 12, 572 branch points, 13 of 144 task
    draws with return variance; f 0.03 (-0.36 to 0.54) at d = 2, 0.33 (0.00 to 1.00) at 6, 0.18
    (0.00 to 0.73) at 12, pooled 0.14 (-0.13 to 0.44). Fitted to it the model predicts a small
    win for [[0, 2], [6, 2], [28, 2]]: 0.92 at spend 1.00. From the first probe's spread (SD of
    the log ratio 0.20 at 64 batches) a probe needs 3,035 batches per algorithm for its CI to
    exclude 1 with 80% power (1,486 for 50%): about 50 hours per algorithm on this CPU. So no
    powered probe is run here: the predicted gain is too small to test at CPU scale.

The fields a reader changes:
  - `OVERRIDES["rollout.root_group"]` (K0), `["rollout.num_branches"]` (K),
    `["rollout.branch_budget"]`, `["rollout.max_depth"]`: the tree, from the map;
  - `OVERRIDES["train.group_size"]` (N of GRPO/RLOO), `["rollout.budget"]` and
    `["rollout.budget_unit"]`: the matched per-task compute;
  - `OVERRIDES["train.iterations"]` (at least 20 unless the map says otherwise) and
    `["eval.every"]`: how long, and how often the curves are sampled;
  - `SEEDS` (paired: every algorithm runs every seed), `ALGOS` (add "ppo" where time allows);
  - `PROBE`: the probe of the start (Table 2), its algorithms and batches;
  - `ABLATIONS`: K, branch budget, selection rule, step weighting, normalisation (BPO only).
"""

from bpo_jax.study.sweep import Ablation, Probe, Sweep

CONFIG = "experiments/alfworld.py:cpu"  # The experiment file and its variant (no algo=).
ALGOS = ("bpo", "grpo", "rloo")
SEEDS = (0, 1, 2, 3, 4)

# Overrides every run gets (config field below `config.` -> value).
OVERRIDES = {
    "train.iterations": 20,  # Long enough for the curves to say something (issue 13 point 6).
    # Held-out evaluation: every valid_seen and valid_unseen game of the two CPU task types (90),
    # greedy and one sampled episode each, before RL, every 10 iterations and at the end.
    "env.eval_split": "valid_seen,valid_unseen",
    "eval.num_tasks": 0,
    "eval.sampled": True,
    # The "updates to reach" column reads these points. One 90-game evaluation (greedy and
    # sampled, 32 steps) costs about as much as ten RL iterations on this CPU.
    "eval.every": 10,
    "train.group_size": 4,  # N of the independent baselines.
    "rollout.root_group": 3,  # K0 backbones per task (the map: see above).
    "rollout.num_branches": 2,  # K children per branch point.
    "rollout.branch_budget": 2,  # Branch points per backbone.
    "rollout.max_depth": 2,
    "rollout.selector": "action_samples",  # Branch where sampled actions disagree.
    # The start policy, chosen on the dev games (docs/start_policy.md; see STATUS above).
    "env.dev_fraction": 0.3,  # 55 training games held out for choosing it; never cloned.
    "env.num_train_tasks": 0,  # BC and RL on the other 107.
    "env.max_steps": 32,  # The limit it was chosen at (the demonstrator's 95th percentile).
    "bc.demos": "search",
    "bc.steps": 1200,
    "bc.recovery": 0.5,
    "agent.notes": True,
    "agent.max_prompt_tokens": 448,
    "model.tokenizer_split_digits": False,
}

# Table 2: the gradient-variance probe of the start (`probe/shared`): 64 batches of RLOO (the
# reference) and then of BPO at RLOO's measured spend, on the first 4 training tasks, at the
# start's parameters (every algorithm's gradient at the same point).
PROBE = Probe(algos=("rloo", "bpo"), batches=64)

# Ablations of BPO (run names `bpo_<name>/seed_<n>`); empty until the main table is chosen, to
# keep the CPU sweep within its hours. Examples of what goes here:
ABLATIONS: tuple[Ablation, ...] = ()
EXAMPLE_ABLATIONS = (
    Ablation("k4", {"rollout.num_branches": 4}, algos=("bpo",)),
    Ablation("budget4", {"rollout.branch_budget": 4}, algos=("bpo",)),
    Ablation("uniform", {"rollout.selector": "uniform"}, algos=("bpo",)),
    Ablation("pathmass", {"train.step_weighting": "path_mass"}, algos=("bpo",)),
    Ablation("sibstd", {"train.normalize": "sibling_std"}, algos=("bpo",)),
)


def get_sweep() -> Sweep:
    return Sweep(
        config=CONFIG,
        algos=ALGOS,
        seeds=SEEDS,
        overrides=OVERRIDES,
        ablations=ABLATIONS,
        shared_bc=True,
        bc_once=True,  # One BC start (bc/shared) for every run of every seed.
        share_evals=True,  # Identical evaluations (the start's, per seed) are played once.
        probe=PROBE,
    )
