"""The pieces a run is built from: its tasks, sandbox pool, tokenizer, agent, model and policy.

Training (`bpo_jax.train`) and the gradient probe (`bpo_jax.study.probe`) build them the same way.
"""

from __future__ import annotations

import hashlib
import random

from etils import epath

from bpo_jax import agent as agent_lib
from bpo_jax.agent import NOTES_SYMBOL, SPECIAL_SYMBOLS
from bpo_jax.agent.demos import corpus, notes_fn
from bpo_jax.config import DTYPES, ExperimentConfig
from bpo_jax.models import config as model_config
from bpo_jax.models.factory import create_model
from bpo_jax.models.lora import LoraConfig, apply_lora
from bpo_jax.parallel import distributed
from bpo_jax.sampler.policy import Policy
from bpo_jax.tokenizer import load_gguf_tokenizer, load_tokenizer, train_sentencepiece


def is_dev_task(task_id: str, dev_fraction: float) -> bool:
    """Whether a training game is held out as a development game (`env.dev_fraction`).

    Decided by the task id alone (its SHA-256 read as a number in [0, 1)), so a game's side
    does not depend on the seed, the task types, or which other games exist.
    """
    if dev_fraction <= 0:
        return False
    digest = hashlib.sha256(task_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < dev_fraction


def select_tasks(cfg: ExperimentConfig):
    """Training tasks and evaluation tasks per split, chosen deterministically from the seed.

    Returns:
      (train, {split: tasks}). An evaluation split equal to the training split evaluates on the
      first `eval.num_tasks` training tasks themselves (an in-distribution check); the split
      "dev" on the training games held out by `env.dev_fraction` (`is_dev_task`; they are never
      among the training tasks); another split gives its first `eval.num_tasks` games after a
      seeded shuffle (0 = all of them). With `env.train_split="dev"` the run trains on the dev
      games instead (of the "train" split), to choose settings in-distribution without the games
      a default run reports.
    """
    from envs.base import load_tasks

    e = cfg.env
    root = e.data_root or None
    opts = dict(e.task_options)
    types = tuple(e.task_types) or None
    on_dev = e.train_split == "dev"
    train = load_tasks(e.name, root, "train" if on_dev else e.train_split, types, **opts)
    dev = [t for t in train if is_dev_task(t.task_id, e.dev_fraction)]
    train = dev if on_dev else [t for t in train if not is_dev_task(t.task_id, e.dev_fraction)]
    train = list(train)
    random.Random(cfg.seed).shuffle(train)
    if e.num_train_tasks:
        train = train[: e.num_train_tasks]
    n = cfg.eval.num_tasks or None
    evals = {}
    for split in e.eval_splits:
        if split == e.train_split:
            evals[split] = train[:n]
        elif split == "dev":
            evals[split] = dev[:n]  # In task-id order: the same games whatever the seed.
        else:
            tasks = load_tasks(e.name, root, split, types, **opts)
            random.Random(cfg.seed + 1).shuffle(tasks)
            evals[split] = tasks[:n]
    return train, evals


def make_pool(cfg: ExperimentConfig):
    """The environment's sandbox pool (a context manager that closes every worker)."""
    from envs.sandbox import SandboxPool

    env_kwargs = {
        "max_steps": cfg.env.max_steps,
        "invalid_action_penalty": cfg.env.invalid_action_penalty,
        **dict(cfg.env.env_options),
    }
    return SandboxPool(
        cfg.env.name, env_kwargs, backend=cfg.env.sandbox_backend, num_workers=cfg.env.num_workers
    )


def build_tokenizer(cfg: ExperimentConfig, workdir: epath.Path, demos):
    """The configured tokenizer, the checkpoint's (or GGUF file's), or (tiny policy) one trained
    on the demos."""
    if cfg.model.tokenizer:
        return load_tokenizer(cfg.model.tokenizer)
    if cfg.model.hf_checkpoint:
        return load_tokenizer(cfg.model.hf_checkpoint)
    if cfg.model.gguf:
        return load_gguf_tokenizer(cfg.model.gguf)
    path = workdir / "tokenizer.model"
    if path.exists():
        return load_tokenizer(path)
    notes = agent_notes(cfg)
    texts = corpus(demos, cfg.agent.history_turns, notes)
    return train_sentencepiece(
        texts,
        workdir / "tokenizer",
        cfg.model.tokenizer_vocab_size,
        user_defined_symbols=SPECIAL_SYMBOLS + ((NOTES_SYMBOL,) if notes else ()),
        split_digits=cfg.model.tokenizer_split_digits,
    )


def agent_notes(cfg: ExperimentConfig):
    """The tiny agent's notes function for the environment (`agent.notes`), or None."""
    return notes_fn(cfg.env.name) if cfg.agent.notes else None


def make_agent(cfg: ExperimentConfig, tokenizer):
    """The configured turn format (`agent.format`) over `tokenizer`: what builds each turn's
    prompt and parses each answer (`bpo_jax.agent`)."""
    a = cfg.agent
    return agent_lib.make_agent(
        a.format,
        tokenizer,
        history_turns=a.history_turns,
        max_prompt_tokens=a.max_prompt_tokens,
        env_name=cfg.env.name,
        max_steps=cfg.env.max_steps,
        notes=agent_notes(cfg),
    )


def lora_config(cfg: ExperimentConfig) -> LoraConfig | None:
    """The adapters of `model.lora` (stored in `model.param_dtype`), or None (rank 0)."""
    lo = cfg.model.lora
    if not lo.rank:
        return None
    return LoraConfig(lo.rank, lo.alpha, tuple(lo.targets), DTYPES[cfg.model.param_dtype])


def base_dtypes(cfg: ExperimentConfig):
    """(compute dtype, storage dtype of the base weights): with LoRA the frozen base is stored
    in the compute dtype (no float32 master copy: it is never updated)."""
    dtype = DTYPES[cfg.model.dtype]
    return dtype, dtype if cfg.model.lora.rank else DTYPES[cfg.model.param_dtype]


def build_model(cfg: ExperimentConfig, tokenizer, mesh):
    """(model config, NNX model), created sharded on `mesh` (or imported from HF or GGUF
    weights), with `model.lora`'s adapters added over the base where set."""
    m = cfg.model
    dtype, param_dtype = base_dtypes(cfg)
    if m.gguf or m.hf_checkpoint:  # Imported weights (exclusive: the config checks it).
        if m.gguf:
            from bpo_jax.models.gguf import load_gguf as load
        else:
            from bpo_jax.models.hf_import import load_hf_checkpoint as load
        mcfg, model = load(
            m.gguf or m.hf_checkpoint,
            mesh=mesh,
            rules=cfg.mesh.rules,
            dtype=dtype,
            param_dtype=param_dtype,
            max_seq_len=m.max_seq_len,
        )
    else:
        mcfg = model_config.get_preset(
            m.preset,
            vocab_size=tokenizer.vocab_size,
            max_seq_len=m.max_seq_len,
            dtype=dtype,
            param_dtype=param_dtype,
        )
        model = create_model(mcfg, mesh=mesh, rules=cfg.mesh.rules, seed=cfg.seed)
    lcfg = lora_config(cfg)
    if lcfg is not None:
        apply_lora(model, lcfg, seed=cfg.seed, mesh=mesh, rules=cfg.mesh.rules)
    return mcfg, model


def make_policy(cfg: ExperimentConfig, graphdef, params, tokenizer, mcfg, mesh=None) -> Policy:
    """The acting policy with the experiment's sampling settings and prompt budget."""
    return Policy(
        graphdef,
        params,
        tokenizer,
        mcfg,
        max_new_tokens=cfg.agent.max_action_tokens,
        cache_len=cfg.agent.max_prompt_tokens + cfg.agent.max_action_tokens,
        temperature=cfg.sampler.temperature,
        top_p=cfg.sampler.top_p,
        length_bucket=cfg.sampler.length_bucket,
        prefill_chunk=cfg.sampler.prefill_chunk,
        mesh=_sampler_mesh(cfg, mesh),
        prefix_reuse=cfg.sampler.prefix_reuse,
        slice_wide=cfg.mesh.sampler == "slice",
    )


def _sampler_mesh(cfg: ExperimentConfig, mesh):
    """The policy's mesh: each host's own devices ("host" sampling: each samples for its own
    share of the tasks), or the whole mesh ("slice": the hosts' calls joined in lockstep)."""
    if mesh is None or cfg.mesh.sampler == "slice":
        return mesh
    check_host_sampling(mesh)
    return distributed.local_mesh(mesh)


# TPU device kinds whose multi-host slices have limited ICI routing (v5e reports "TPU v5 lite",
# v6e "TPU v6 lite"): libtpu refuses a program on some of the slice's chips ("On platforms with
# limited ICI routing device assignment should include all slice devices").
_WHOLE_SLICE_ONLY = ("lite", "v5e", "v6e")


def check_host_sampling(mesh) -> None:
    """Fails before the first rollout where per-host sampling cannot run (v5e and v6e pods).

    Raises:
      ValueError: naming the settings that sample slice-wide instead.
    """
    kind = str(getattr(mesh.devices.flat[0], "device_kind", "")).lower()
    hosts = {d.process_index for d in mesh.devices.flat}
    if len(hosts) > 1 and any(k in kind for k in _WHOLE_SLICE_ONLY):
        raise ValueError(
            f"mesh.sampler='host' samples on each host's own chips, which a multi-host "
            f"{kind!r} slice refuses (limited ICI routing: a program must span the whole "
            "slice). Set --config.mesh.sampler=slice --config.sampler.prefix_reuse=False."
        )


def make_critic(cfg: ExperimentConfig, graphdef, width: int, pad_id: int):
    """The algorithm's critic (PPO's value head), or None when it has none."""
    if not cfg.algorithm.needs_critic:
        return None
    from bpo_jax.learner.critic import Critic

    t = cfg.train
    return Critic(graphdef, width, t.value_lr, t.value_epochs, cfg.seed, pad_id)
