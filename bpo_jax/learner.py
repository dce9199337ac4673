"""Losses and the jitted update step: behaviour cloning and the clipped policy gradient.

Everything here is a pure function of arrays. A batch is a set of right-padded token
sequences (prompt + action) with a mask on the action tokens: the only tokens that are trained.

Shape suffixes: B sequences, L sequence length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from bpo_jax.models import sharding
from bpo_jax.models.llama import REMAT_POLICIES

LOSS_AGGS = ("token_mean", "seq_mean")  # How token losses become one number (`_aggregate`).


@flax.struct.dataclass
class TrainState:
    """Everything an update changes: parameters, optimizer state and the update counter."""

    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array


def make_optimizer(
    lr: float, weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.999, grad_clip: float = 0.0
) -> optax.GradientTransformation:
    """AdamW after global-norm clipping (`grad_clip=0` disables clipping).

    The chain's structure does not depend on the arguments, so optimizer states of different
    phases (behaviour cloning, RL) restore into one another's checkpoint template.
    """
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    return optax.chain(
        optax.clip_by_global_norm(max_norm),
        optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay),
    )


@dataclasses.dataclass(frozen=True)
class Batch:
    """A padded batch of sequences (numpy on the host; device arrays inside jit).

    Attributes:
      tokens: int32 [B, L] prompt + action tokens, right-padded.
      loss_mask: float32 [B, L]; 1 where token l is an action token to train (predicted from
        position l - 1).
      advantages: float32 [B, L] per-token advantage (zero for BC).
      old_logprobs: float32 [B, L] log-probs of the tokens under the behaviour policy.
      weights: float32 [B] per-sequence loss weight (default 1 for every real row; 0 for
        padding rows). E.g. 1 / (steps in the sequence's trajectory), so that every trajectory
        weighs the same in the loss however many steps it took.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    old_logprobs: np.ndarray
    weights: np.ndarray


jax.tree_util.register_dataclass(
    Batch,
    data_fields=["tokens", "loss_mask", "advantages", "old_logprobs", "weights"],
    meta_fields=[],
)


def pad_batch(
    sequences: Sequence[Sequence[int]],
    action_starts: Sequence[int],
    *,
    batch_size: int,
    length: int,
    pad_id: int,
    advantages: Sequence[float] | None = None,
    old_logprobs: Sequence[Sequence[float]] | None = None,
    weights: Sequence[float] | None = None,
) -> Batch:
    """Packs sequences into a fixed-shape batch (padding rows get weight 0).

    Args:
      sequences: token ids, prompt followed by action (and its stop token).
      action_starts: index in each sequence of its first action token.
      batch_size, length: the static shape; sequences longer than `length` raise.
      pad_id: padding token.
      advantages: one scalar per sequence (broadcast to its action tokens).
      old_logprobs: per action token log-probs (len == len(seq) - action_start).
      weights: per-sequence loss weights (default 1).
    """
    weights_in = weights
    n = len(sequences)
    if n > batch_size:
        raise ValueError(f"{n} sequences do not fit in a batch of {batch_size}.")
    tokens = np.full((batch_size, length), pad_id, np.int32)
    mask = np.zeros((batch_size, length), np.float32)
    adv = np.zeros((batch_size, length), np.float32)
    old = np.zeros((batch_size, length), np.float32)
    weights = np.zeros((batch_size,), np.float32)
    for i, (seq, start) in enumerate(zip(sequences, action_starts)):
        if len(seq) > length:
            raise ValueError(
                f"Sequence {i} has {len(seq)} tokens, more than the batch length {length}."
            )
        if not 0 < start <= len(seq):
            raise ValueError(f"Sequence {i}: action start {start} outside (0, {len(seq)}].")
        tokens[i, : len(seq)] = seq
        mask[i, start : len(seq)] = 1.0
        weights[i] = 1.0 if weights_in is None else float(weights_in[i])
        if advantages is not None:
            adv[i, start : len(seq)] = advantages[i]
        if old_logprobs is not None:
            lp = np.asarray(old_logprobs[i], np.float32)
            if len(lp) != len(seq) - start:
                raise ValueError(
                    f"Sequence {i}: {len(lp)} old log-probs for {len(seq) - start} tokens."
                )
            old[i, start : len(seq)] = lp
    return Batch(tokens, mask, adv, old, weights)


def token_logprobs(model_fn, params, tokens_bl: jax.Array, temperature: float = 1.0):
    """Log-prob and entropy of each token given its prefix; position 0 gets 0.

    With `temperature != 1` these are of the tempered policy softmax(logits / temperature): the
    distribution the rollouts were sampled from, which is then the policy being optimised (so the
    importance ratios stay on-policy).

    A `model_fn` from `make_model_fn` computes them over chunks of `logits_chunk` positions
    (`chunked_token_logprobs`), so that no [B, L, V] float32 tensor exists, in the forward pass
    or the backward one; any other `fn(params, tokens) -> (logits, _)` is scored whole.

    Returns:
      (logprobs [B, L], entropies [B, L]) in float32.
    """
    features = getattr(model_fn, "features", None)
    if features is not None:
        hidden_btd, head_dv = features(params, tokens_bl[:, :-1])
        logp, ent = chunked_token_logprobs(
            hidden_btd, head_dv, tokens_bl[:, 1:], temperature, model_fn.logits_chunk
        )
    else:
        logits, _ = model_fn(params, tokens_bl[:, :-1])
        logp, ent = _logprob_entropy(logits, tokens_bl[:, 1:], temperature)
    pad = jnp.zeros_like(logp[:, :1])
    return jnp.concatenate([pad, logp], axis=1), jnp.concatenate([pad, ent], axis=1)


def _logprob_entropy(logits_btv, targets_bt, temperature: float):
    """Log-prob of `targets_bt` and entropy of softmax(logits / temperature), in float32."""
    logp_all = jax.nn.log_softmax(logits_btv.astype(jnp.float32) / temperature, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets_bt[..., None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, ent


def chunked_token_logprobs(
    hidden_btd: jax.Array,
    head_dv: jax.Array,
    targets_bt: jax.Array,
    temperature: float = 1.0,
    chunk: int = 0,
):
    """Log-probs of `targets_bt` and entropies from final hidden states, C positions at a time.

    The LM head, the log-softmax and the entropy run inside a `lax.scan` over chunks of `chunk`
    positions whose body is rematerialised (`jax.checkpoint`): the forward pass holds one
    chunk's [B, C, V] float32 logits at a time, and the backward pass recomputes each chunk's
    logits from its [B, C, D] hidden states instead of keeping them. At Qwen2.5-7B's 152k
    vocabulary a 1024-token sequence's float32 logits are 0.6 GB; a 128-position chunk's, 78 MB.

    Args:
      hidden_btd: [B, T, D] final-norm hidden states (compute dtype).
      head_dv: [D, V] LM head (compute dtype).
      targets_bt: int32 [B, T] the token each position predicts.
      temperature: the policy's sampling temperature.
      chunk: positions per chunk; 0 (or >= T) scores the whole sequence at once.

    Returns:
      (logprobs [B, T], entropies [B, T]) in float32.
    """
    b, t, d = hidden_btd.shape

    def score(h_bcd, y_bc):
        logits_bcv = jnp.einsum("bcd,dv->bcv", h_bcd, head_dv, preferred_element_type=jnp.float32)
        logits_bcv = sharding.constrain(logits_bcv, ("batch", "length", "vocab"))
        return _logprob_entropy(logits_bcv, y_bc, temperature)

    if chunk <= 0 or chunk >= t:
        return score(hidden_btd, targets_bt)
    n = -(-t // chunk)
    pad = n * chunk - t
    h = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0)))
    y = jnp.pad(targets_bt, ((0, 0), (0, pad)))
    # [B, N C, ...] -> [N, B, C, ...]: the scan runs over chunks; rows keep their sharding.
    h_nbcd = h.reshape(b, n, chunk, d).transpose(1, 0, 2, 3)
    y_nbc = y.reshape(b, n, chunk).transpose(1, 0, 2)

    @jax.checkpoint
    def body(_, xs):
        return None, score(*xs)

    _, (logp_nbc, ent_nbc) = jax.lax.scan(body, None, (h_nbcd, y_nbc))
    logp = logp_nbc.transpose(1, 0, 2).reshape(b, n * chunk)[:, :t]
    ent = ent_nbc.transpose(1, 0, 2).reshape(b, n * chunk)[:, :t]
    return logp, ent


def _safe_div(num, den):
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def _aggregate(x_bl, mask_bl, weights_b, loss_agg: str):
    """Weighted mean of x over the masked tokens.

    token_mean: every token weighs its sequence's weight. seq_mean: each sequence's token mean
    weighs its sequence's weight (so long and short actions count alike).
    """
    if loss_agg == "token_mean":
        w_bl = mask_bl * weights_b[:, None]
        return _safe_div(jnp.sum(x_bl * w_bl), jnp.sum(w_bl))
    if loss_agg == "seq_mean":
        n_b = jnp.sum(mask_bl, axis=1)
        per_seq = _safe_div(jnp.sum(x_bl * mask_bl, axis=1), n_b)
        w_b = weights_b * (n_b > 0)
        return _safe_div(jnp.sum(per_seq * w_b), jnp.sum(w_b))
    raise ValueError(f"Unknown loss_agg {loss_agg!r}; expected one of {LOSS_AGGS}.")


def bc_loss(model_fn, params, batch: Batch):
    """Negative log-likelihood of the action tokens (behaviour cloning)."""
    logp, ent = token_logprobs(model_fn, params, batch.tokens)
    mask = batch.loss_mask * (batch.weights[:, None] > 0)
    loss = -_aggregate(logp, mask, batch.weights, "token_mean")
    acc_den = jnp.maximum(jnp.sum(mask), 1.0)
    return loss, {"nll": loss, "entropy": jnp.sum(ent * mask) / acc_den}


def pg_loss(
    model_fn,
    params,
    batch: Batch,
    *,
    clip_eps: float,
    loss_agg: str,
    kl_coef: float = 0.0,
    ref_logprobs: jax.Array | None = None,
    temperature: float = 1.0,
):
    """Token-level clipped policy-gradient loss (PPO/GRPO surrogate).

    Per action token: `-min(r A, clip(r, 1 - eps, 1 + eps) A)` with `r = exp(logp - old_logp)`,
    aggregated by `loss_agg`. With `kl_coef > 0` adds `kl_coef * KL(pi || ref)` using the
    non-negative k3 estimator `exp(ref - logp) - (ref - logp) - 1`.
    """
    logp, ent = token_logprobs(model_fn, params, batch.tokens, temperature)
    mask = batch.loss_mask * (batch.weights[:, None] > 0)
    log_ratio = jnp.where(mask > 0, logp - batch.old_logprobs, 0.0)
    ratio = jnp.exp(log_ratio)
    adv = batch.advantages
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    surrogate = jnp.minimum(unclipped, clipped)
    loss = -_aggregate(surrogate, mask, batch.weights, loss_agg)
    den = jnp.maximum(jnp.sum(mask), 1.0)
    metrics = {
        "pg_loss": loss,
        "entropy": jnp.sum(ent * mask) / den,
        "clip_frac": jnp.sum((jnp.abs(ratio - 1.0) > clip_eps) * mask) / den,
        "approx_kl_old": jnp.sum((ratio - 1.0 - log_ratio) * mask) / den,
    }
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference log-probs.")
        d = jnp.where(mask > 0, ref_logprobs - logp, 0.0)
        kl = _aggregate(jnp.exp(d) - d - 1.0, mask, batch.weights, loss_agg)
        loss = loss + kl_coef * kl
        metrics["kl_ref"] = kl
    metrics["loss"] = loss
    return loss, metrics


def make_model_fn(
    graphdef, *, remat: str = "none", logits_chunk: int = 0, scan_layers: bool = False
):
    """Wraps an NNX graphdef into `fn(params, tokens) -> (logits, None)`.

    The function also carries `fn.features(params, tokens) -> (hidden [B, T, D], head [D, V])`
    and `fn.logits_chunk`, which `token_logprobs` uses to score tokens chunk by chunk.

    Args:
      graphdef: a `Transformer`'s graphdef.
      remat: the decoder layers' rematerialisation policy (`llama.REMAT_POLICIES`).
      logits_chunk: positions per chunk of the LM head in `token_logprobs` (0 = all at once).
      scan_layers: run the decoder layers as one `lax.scan` (`Transformer(scan_layers=)`).
    """
    if remat not in REMAT_POLICIES:
        raise ValueError(f"Unknown remat policy {remat!r}; known: {sorted(REMAT_POLICIES)}.")

    def model_fn(params, tokens_bl):
        model = nnx.merge(graphdef, params)
        return model(tokens_bl, remat=remat, scan_layers=scan_layers)

    def features(params, tokens_bl):
        model = nnx.merge(graphdef, params)
        # The logits the model also returns are dead code here, and XLA removes them.
        _, _, hidden_btd = model(
            tokens_bl, remat=remat, scan_layers=scan_layers, return_hidden=True
        )
        return hidden_btd, model.head_weight()

    model_fn.features = features
    model_fn.logits_chunk = int(logits_chunk)
    return model_fn


def loss_denominator(batch: Batch, loss_agg: str) -> jax.Array:
    """The weight sum that `_aggregate` divides a batch's loss by (see `make_train_step`)."""
    mask_bl = batch.loss_mask * (batch.weights[:, None] > 0)
    if loss_agg == "token_mean":
        return jnp.sum(mask_bl * batch.weights[:, None])
    if loss_agg == "seq_mean":
        return jnp.sum(batch.weights * (jnp.sum(mask_bl, axis=1) > 0))
    raise ValueError(f"Unknown loss_agg {loss_agg!r}; expected one of {LOSS_AGGS}.")


def state_shardings(optimizer: optax.GradientTransformation, params, param_shardings):
    """Shardings of a `TrainState`: the optimizer's per-parameter state laid out like the
    parameters, everything else (counts, the step) replicated.

    Args:
      optimizer: the optax transformation.
      params: the parameters (arrays or `jax.ShapeDtypeStruct`s).
      param_shardings: the parameters' shardings (`factory.param_specs`), same tree.

    Returns:
      A `TrainState` of `NamedSharding`s.
    """
    mesh = jax.tree.leaves(param_shardings)[0].mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    by_path = {
        path: (spec, param.shape)
        for (path, spec), param in zip(
            jax.tree_util.tree_leaves_with_path(param_shardings), jax.tree.leaves(params)
        )
    }

    def spec_of(path, leaf):
        # A per-parameter state leaf (Adam's mu, nu) sits at the parameter's own path below
        # the optimizer's nesting: match the longest path suffix with the parameter's shape.
        for i in range(len(path)):
            hit = by_path.get(tuple(path[i:]))
            if hit is not None and tuple(hit[1]) == tuple(leaf.shape):
                return hit[0]
        return replicated

    abstract_opt = jax.eval_shape(optimizer.init, params)
    opt = jax.tree_util.tree_map_with_path(spec_of, abstract_opt)
    return TrainState(params=param_shardings, opt_state=opt, step=replicated)


def make_train_step(
    graphdef,
    optimizer: optax.GradientTransformation,
    loss_fn,
    *,
    microbatch_size: int = 0,
    loss_agg: str = "token_mean",
    remat: str = "none",
    logits_chunk: int = 0,
    scan_layers: bool = False,
    shardings: TrainState | None = None,
):
    """Builds the jitted update: `(state, batch, *extra) -> (state, metrics)`.

    The state's buffers are donated: the update happens in place on the device. The global
    gradient norm (before clipping) is reported every step.

    Gradient accumulation: with `0 < microbatch_size < B`, the B rows (and every per-row array
    in `extra`) are split into B / microbatch_size microbatches (rows m, m + n, m + 2n, ... for
    n microbatches, so each device keeps its own rows), run one after another in a `lax.scan`,
    and their gradients summed in float32, each weighted by its share of the batch's loss
    denominator (`loss_denominator`). Since the losses are weighted means, that is the gradient
    of the whole batch's loss: the update equals the unaccumulated one. The loss metrics are
    combined with the same weights.

    Args:
      graphdef, optimizer, loss_fn: the model, the optax transformation and
        `loss_fn(model_fn, params, batch, *extra) -> (loss, metrics)`.
      microbatch_size: rows per microbatch; 0 (or B) runs the batch at once. Must divide B.
      loss_agg: how `loss_fn` aggregates token losses (the microbatch weights).
      remat, logits_chunk, scan_layers: see `make_model_fn`.
      shardings: the `TrainState`'s shardings (`state_shardings`): the state's input and output
        shardings, and the layout of the gradient accumulators.
    """
    model_fn = make_model_fn(
        graphdef, remat=remat, logits_chunk=logits_chunk, scan_layers=scan_layers
    )

    def grads_of(params, batch, extra):
        def objective(p):
            return loss_fn(model_fn, p, batch, *extra)

        return jax.value_and_grad(objective, has_aux=True)(params)

    def accumulated(params, batch, extra):
        rows = batch.tokens.shape[0]
        if microbatch_size <= 0 or microbatch_size >= rows:
            return grads_of(params, batch, extra)
        if rows % microbatch_size:
            raise ValueError(
                f"train.microbatch_size ({microbatch_size}) must divide the batch's {rows} rows."
            )
        n = rows // microbatch_size
        # Row r = m * n + j goes to microbatch j: a row-sharded batch splits without moving.
        split = jax.tree.map(
            lambda x: jnp.swapaxes(x.reshape(microbatch_size, n, *x.shape[1:]), 0, 1),
            (batch, extra),
        )
        total = loss_denominator(batch, loss_agg)
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        if shardings is not None:
            zeros = jax.lax.with_sharding_constraint(zeros, shardings.params)

        def body(carry, xs):
            grad_sum, loss_sum, metric_sum = carry
            mb, mb_extra = xs
            mb = jax.tree.map(
                lambda x: sharding.constrain(x, ("batch",) + (None,) * (x.ndim - 1)), mb
            )
            (loss, metrics), grads = grads_of(params, mb, mb_extra)
            share = _safe_div(loss_denominator(mb, loss_agg), total)
            grad_sum = jax.tree.map(lambda a, g: a + share * g.astype(jnp.float32), grad_sum, grads)
            metric_sum = jax.tree.map(lambda a, m: a + share * m, metric_sum, metrics)
            return (grad_sum, loss_sum + share * loss, metric_sum), None

        first = jax.tree.map(lambda x: x[0], split)
        metric_zeros = jax.tree.map(
            jnp.zeros_like, jax.eval_shape(lambda: grads_of(params, *first)[0][1])
        )
        (grad_sum, loss, metrics), _ = jax.lax.scan(
            body, (zeros, jnp.float32(0.0), metric_zeros), split
        )
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grad_sum, params)
        return (loss, metrics), grads

    def train_step(state: TrainState, batch: Batch, *extra):
        (loss, metrics), grads = accumulated(state.params, batch, extra)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(
            metrics, loss=loss, grad_norm=optax.tree.norm(grads), param_norm=optax.tree.norm(params)
        )
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics

    if shardings is None:
        return jax.jit(train_step, donate_argnums=(0,))
    return jax.jit(train_step, donate_argnums=(0,), out_shardings=(shardings, None))


def make_logprob_fn(graphdef, temperature: float = 1.0, *, logits_chunk: int = 0):
    """Jitted `(params, tokens) -> (logprobs, entropies)` for scoring rollouts."""
    model_fn = make_model_fn(graphdef, logits_chunk=logits_chunk)
    return jax.jit(lambda params, tokens: token_logprobs(model_fn, params, tokens, temperature))


# ------------------------------------------------------------------ host side of the update


def round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


@dataclasses.dataclass
class Example:
    """One training sequence: a step's prompt followed by the tokens the policy generated."""

    tokens: list[int]
    action_start: int
    advantage: float
    weight: float = 1.0  # Loss weight (see `RolloutForest.step_weights`).


def minibatches(items: Sequence, size: int, rng: np.random.Generator):
    order = rng.permutation(len(items))
    for i in range(0, len(order), size):
        yield [items[j] for j in order[i : i + size]]


class RLUpdater:
    """Holds the jitted update and scoring functions for the clipped policy gradient."""

    def __init__(
        self, graphdef, cfg, pad_id: int, write: Callable[[int, dict], None], *, params=None
    ):
        """Builds the update for `cfg`'s train section.

        Args:
          graphdef: the policy's graphdef.
          cfg: the `config.ExperimentConfig`.
          pad_id: the padding token of update batches.
          write: `write(step, metrics)` of the run's metric writer.
          params: the policy's parameters (arrays or `ShapeDtypeStruct`s with `NamedSharding`s):
            when given, the update's state shardings are explicit (`state_shardings`), the
            optimizer state laid out like the parameters.
        """
        t = cfg.train
        self.cfg = cfg
        self.pad_id = pad_id
        self.write = write
        self.optimizer = make_optimizer(t.lr, t.weight_decay, t.b1, t.b2, t.grad_clip)
        # The policy optimised is the tempered one the rollouts sample from.
        temp = cfg.sampler.temperature

        def loss(fn, params, batch, ref_logprobs=None):
            return pg_loss(
                fn,
                params,
                batch,
                clip_eps=t.clip_eps,
                loss_agg=t.loss_agg,
                temperature=temp,
                kl_coef=t.kl_coef,
                ref_logprobs=ref_logprobs,
            )

        shardings = None
        if params is not None:
            shardings = state_shardings(
                self.optimizer, params, jax.tree.map(lambda x: x.sharding, params)
            )
        self.step_fn = make_train_step(
            graphdef,
            self.optimizer,
            loss,
            microbatch_size=t.microbatch_size,
            loss_agg=t.loss_agg,
            remat=cfg.model.remat,
            logits_chunk=t.logits_chunk,
            scan_layers=cfg.model.scan_layers,
            shardings=shardings,
        )
        self.logprob_fn = make_logprob_fn(graphdef, temp, logits_chunk=t.logits_chunk)

    def update(
        self,
        state: TrainState,
        examples: list[Example],
        seed: Sequence[int],
        ref_params=None,
    ):
        """Runs `train.epochs` passes of minibatch updates; returns (state, per-update metrics).

        `ref_params` (the frozen reference policy) is needed when `train.kl_coef > 0`.
        """
        if self.cfg.train.kl_coef > 0 and ref_params is None:
            raise ValueError("config.train.kl_coef > 0 needs the reference policy's parameters.")
        t = self.cfg.train
        rng = np.random.default_rng(list(seed))
        # Behaviour log-probs for every example, from the parameters the rollouts used, before
        # any update: with several minibatches or epochs the ratios are then true PPO ratios.
        batches = []
        for chunk in minibatches(examples, t.minibatch_size, rng):
            length = round_up(max(len(e.tokens) for e in chunk), self.cfg.sampler.length_bucket)
            batch = pad_batch(
                [e.tokens for e in chunk],
                [e.action_start for e in chunk],
                batch_size=t.minibatch_size,
                length=length,
                pad_id=self.pad_id,
                advantages=[e.advantage for e in chunk],
                weights=[e.weight for e in chunk],
            )
            old_lp, _ = self.logprob_fn(state.params, batch.tokens)
            extra = ()
            if t.kl_coef > 0:
                extra = (self.logprob_fn(ref_params, batch.tokens)[0],)
            batches.append(
                (
                    dataclasses.replace(batch, old_logprobs=np.asarray(old_lp) * batch.loss_mask),
                    extra,
                )
            )
        history = []
        for epoch in range(t.epochs):
            order = rng.permutation(len(batches)) if epoch else range(len(batches))
            for i in order:
                batch, extra = batches[i]
                state, metrics = self.step_fn(state, batch, *extra)
                metrics = {k: float(v) for k, v in metrics.items()}
                history.append(metrics)
                self.write(
                    int(state.step),
                    {"update/grad_norm": metrics["grad_norm"], "update/loss": metrics["loss"]},
                )
        return state, history
