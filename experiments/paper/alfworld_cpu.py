r"""The CPU table: BPO, GRPO and RLOO on ALFWorld's `cpu` variant, 5 paired seeds.

  python -m bpo_jax.sweep --sweep=experiments/paper/alfworld_cpu.py --workdir=runs/alfworld_cpu \
      --commit_to=results/alfworld_cpu
  python -m bpo_jax.tables --runs=results/alfworld_cpu --out=docs/results/alfworld_cpu

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

STATUS (2026-12-01): NOT READY TO RUN. Two findings stopped the first attempt after its shared
behaviour-cloning start (`bc/seed_0`), before any RL run:
  - the BC policy (150 steps on the 24 training games) won 0 of 48 valid_seen games: it
    memorises its training games, so every algorithm would start the held-out tables at zero;
    the start must be a policy that wins held-out games (BC on every training game of the two
    types, chosen on training / valid_seen games, never on results);
  - at K0 = 3 the `action_samples` probes spent most of the one episode the backbones leave
    (`bench/bench_branch_rules.py --set rollout.root_group=3`: 0 and 2 branch points in the
    first two batches, at spend 0.93 and 1.13). Addressed: probes spend half of each task's
    slack (`rollout.probe_share=0.5`), spread over its remaining steps: 4 batches spent 0.93
    (95% CI 0.90-0.95) of the budget on 10 branch points at mean step 5.7, against 1.10 on 6,
    all at t = 0, when probing every step (`docs/results.md`, `branch_rules_k0_3.json`).
Left: the start policy (the first finding). `docs/start_policy.md` chooses it on held-out
training games (`env.dev_fraction=0.3`, 55 dev games), never on the tables' games: a searching
demonstrator that reads only the text (`bc.demos=search`) wins all 162 training games, but the
first policy cloned from it (150 steps, max_steps 32) won 0 of 55 dev games (underfit: 1.8
passes over its 1,326 pairs); the longer BC runs and the walkthrough row are still to run.

The fields a reader changes:
  - `OVERRIDES["rollout.root_group"]` (K0), `["rollout.num_branches"]` (K),
    `["rollout.branch_budget"]`, `["rollout.max_depth"]`: the tree, from the map;
  - `OVERRIDES["train.group_size"]` (N of GRPO/RLOO), `["rollout.budget"]` and
    `["rollout.budget_unit"]`: the matched per-task compute;
  - `OVERRIDES["train.iterations"]` (at least 20 unless the map says otherwise) and
    `["eval.every"]`: how long, and how often the curves are sampled;
  - `SEEDS` (paired: every algorithm runs every seed), `ALGOS` (add "ppo" where time allows);
  - `ABLATIONS`: K, branch budget, selection rule, step weighting, normalisation (BPO only).
"""

from bpo_jax.sweep import Ablation, Sweep

CONFIG = "experiments/alfworld.py:cpu"  # The experiment file and its variant (no algo=).
ALGOS = ("bpo", "grpo", "rloo")
SEEDS = (0, 1, 2, 3, 4)

# Overrides every run gets (config field below `config.` -> value).
OVERRIDES = {
    "train.iterations": 20,  # Long enough for the curves to say something (issue 13 point 6).
    # Held-out evaluation: every valid_seen and valid_unseen game of the two CPU task types (90),
    # greedy and one sampled episode each, before RL, every 5 iterations and at the end.
    "env.eval_split": "valid_seen,valid_unseen",
    "eval.num_tasks": 0,
    "eval.sampled": True,
    "eval.every": 5,  # The "updates to reach" column reads these points.
    "train.group_size": 4,  # N of the independent baselines.
    "rollout.root_group": 3,  # K0 backbones per task (the map: see above).
    "rollout.num_branches": 2,  # K children per branch point.
    "rollout.branch_budget": 2,  # Branch points per backbone.
    "rollout.max_depth": 2,
    "rollout.selector": "action_samples",  # Branch where sampled actions disagree.
}

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
        shared_bc=True,  # BC once per seed; every algorithm of the seed starts from it.
    )
