r"""Does a behaviour-cloned policy choose the demonstrator's action in games it was not cloned on?

Teacher-forced, step by step: every state of the searching demonstrator's episodes is rendered
as the agent's prompt (its turn format, notes included), and the policy's greedy choice there
is compared with the demonstrator's action: an example counts as matched when the argmax of
every action token (and of the stop token after it) is the demonstrator's, which is exactly
when greedy decoding writes that action. Reported per split, on the games the policy was cloned
on (`train`: the run's cached demos) and on games it was not (`dev` or another evaluation
split, whose demos this plays): matched share overall and per command verb, and the mean
negative log-likelihood per action token. A policy that matches its training games' actions
but not the held-out games' memorised its games; one that matches both but loses the held-out
games compounds rare errors (behaviour cloning's covariate shift).

  PYTHONPATH=$PWD python bench/bc_generalization.py \
      --source=/work/runs/start_policy/search_rec5_notes_s1200_m32 \
      --set env.eval_split=dev --json=/tmp/bc_generalization.json

The held-out demos are cached in `--demo_cache` (default: the source's
`<split>_search_demos.json`), so a second policy on the same games does not replay them.
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from play_transcripts import parse_source, source_parser

from bpo_jax import learner
from bpo_jax.agent.demos import bc_examples, load_or_play
from bpo_jax.builders import agent_notes
from bpo_jax.train import open_run, setup

VERBS = ("go to", "open", "examine", "take", "move", "use")


def verb(action: str) -> str:
    return next((v for v in VERBS if action.startswith(v)), "other")


def score(model_fn, params, examples, pad_id: int, batch_size: int = 16, bucket: int = 64):
    """Per example: (greedy writes the action, mean NLL of its tokens)."""

    @jax.jit
    def logits_of(params, tokens):
        logits, _ = model_fn(params, tokens[:, :-1])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        target = tokens[:, 1:]
        nll = -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
        return jnp.argmax(logits, axis=-1) == target, nll

    matched, nlls = [], []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        length = learner.round_up(max(len(s) for s, _ in chunk), bucket)
        tokens = np.full((batch_size, length), pad_id, np.int32)
        for r, (seq, _) in enumerate(chunk):
            tokens[r, : len(seq)] = seq
        hit, nll = jax.device_get(logits_of(params, jnp.asarray(tokens)))
        for r, (seq, start) in enumerate(chunk):
            # Position p of hit/nll predicts token p + 1: the action is tokens [start, len).
            span = slice(start - 1, len(seq) - 1)
            matched.append(bool(hit[r, span].all()))
            nlls.append(float(nll[r, span].mean()))
    return matched, nlls


def summarise(demos, matched, nlls) -> dict:
    actions = [a for d in demos if d["won"] for a in d["actions"]]
    assert len(actions) == len(matched), (len(actions), len(matched))
    by_verb = defaultdict(list)
    for a, m in zip(actions, matched):
        by_verb[verb(a)].append(m)
    return {
        "games": sum(d["won"] for d in demos),
        "examples": len(matched),
        "matched": float(np.mean(matched)),
        "nll_per_token": float(np.mean(nlls)),
        "matched_by_verb": {v: [float(np.mean(ms)), len(ms)] for v, ms in sorted(by_verb.items())},
    }


def main(argv=None) -> int:
    ap = source_parser(__doc__.split("\n")[0])
    ap.add_argument("--demo_cache", default="", help="held-out demos (default: in --source)")
    args, source, cfg = parse_source(ap, argv)
    train_demos = json.loads((source / "search_demos.json").read_text())
    report = {"source": str(source)}
    with tempfile.TemporaryDirectory() as tmp, open_run(cfg, Path(tmp)) as (run, mcfg, params):
        state = setup(run, mcfg, params)
        split, tasks = next(iter(run.eval_tasks.items()))
        cache = Path(args.demo_cache or source / f"{split}_search_demos.json")
        held_out = load_or_play(cache, run.pool, tasks, "search", cfg.env.name)
        model_fn = learner.make_model_fn(run.graphdef)
        a = cfg.agent
        for name, demos in (("train", train_demos), (split, held_out)):
            examples = bc_examples(
                demos, run.tokenizer, a.history_turns, a.max_prompt_tokens, notes=agent_notes(cfg)
            )
            matched, nlls = score(model_fn, state.train.params, examples, run.tokenizer.pad_id)
            report[name] = summarise(demos, matched, nlls)
            print(name, json.dumps(report[name]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
