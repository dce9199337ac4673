"""The train state, the optimizer, and the jitted donated update step (microbatching, remat,
shardings).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from bpo_jax.learner.batch import Batch
from bpo_jax.learner.losses import _safe_div, loss_denominator, token_logprobs
from bpo_jax.models import lora, sharding
from bpo_jax.models.llama import REMAT_POLICIES


@flax.struct.dataclass
class TrainState:
    """Everything an update changes: parameters, optimizer state and the update counter."""

    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array


def trainable(params):
    """The parameters an update trains: the LoRA adapters where the model has them (the base
    is frozen), else all of them."""
    return lora.split_adapters(params)[0] if lora.has_lora(params) else params


def _with_trainable(params, new_trainable):
    """`params` with its trainable part replaced (`trainable`)."""
    if not lora.has_lora(params):
        return new_trainable
    return lora.merge(lora.split_adapters(params)[1], new_trainable)


def reference_params(params):
    """The KL reference's parameters: a copy of the policy, or with LoRA its adapters zeroed
    (the reference is the base with adapters off; `full_reference` joins them to the base that
    the policy shares, so there is no second copy of the model)."""
    if lora.has_lora(params):
        return jax.tree.map(jnp.zeros_like, trainable(params))
    return jax.tree.map(jnp.copy, params)


def full_reference(params, ref_params):
    """The reference's whole parameters from `reference_params`' output (LoRA: the policy's
    frozen base with the reference's adapters)."""
    if lora.has_lora(params) and not jax.tree.leaves(lora.split_adapters(ref_params)[1]):
        return lora.merge(lora.split_adapters(params)[1], ref_params)
    return ref_params


def make_optimizer(
    lr: float, weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.999, grad_clip: float = 0.0
) -> optax.GradientTransformation:
    """AdamW after global-norm clipping (`grad_clip=0` disables clipping), over `trainable`
    parameters only: with LoRA its state holds moments of the adapters, none of the base.

    The chain's structure does not depend on the arguments, so optimizer states of different
    phases (behaviour cloning, RL) restore into one another's checkpoint template.
    """
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    inner = optax.chain(
        optax.clip_by_global_norm(max_norm),
        optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay),
    )

    def update(grads, opt_state, params=None):
        # The updates and gradients are over the trainable parameters (`make_train_step`).
        return inner.update(grads, opt_state, None if params is None else trainable(params))

    return optax.GradientTransformation(lambda params: inner.init(trainable(params)), update)


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

    `scale` (keyword, a float32 scalar) multiplies the loss and its gradient before the
    optimizer (clipping included) sees them: the step of a minibatch from the part of it whose
    losses are not zero (`RLUpdater.update`).

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
        # Gradients of the trainable parameters only (LoRA: the adapters; `trainable`).
        def objective(p):
            return loss_fn(model_fn, _with_trainable(params, p), batch, *extra)

        return jax.value_and_grad(objective, has_aux=True)(trainable(params))

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
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trainable(params))
        if shardings is not None:
            zeros = jax.lax.with_sharding_constraint(zeros, trainable(shardings.params))

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
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grad_sum, trainable(params))
        return (loss, metrics), grads

    def train_step(state: TrainState, batch: Batch, *extra, scale=None):
        (loss, metrics), grads = accumulated(state.params, batch, extra)
        if scale is not None:
            # The batch holds part of a minibatch whose other rows have a zero loss: its loss
            # (a weighted mean over its rows) times its share of the minibatch's denominator
            # is the minibatch's loss (`RLUpdater.update`).
            loss = loss * scale
            grads = jax.tree.map(lambda g: (g.astype(jnp.float32) * scale).astype(g.dtype), grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        new = optax.apply_updates(trainable(state.params), updates)
        params = _with_trainable(state.params, new)
        metrics = dict(
            metrics, loss=loss, grad_norm=optax.tree.norm(grads), param_norm=optax.tree.norm(params)
        )
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics

    if shardings is None:
        return jax.jit(train_step, donate_argnums=(0,))
    return jax.jit(train_step, donate_argnums=(0,), out_shardings=(shardings, None))


def make_zero_step(optimizer: optax.GradientTransformation, shardings: TrainState | None = None):
    """Builds the jitted optimizer step on a zero gradient: `state -> (state, metrics)`.

    What `make_train_step` does for a minibatch whose every loss term is zero, without running
    the model: the optimizer still steps (Adam's moments decay and its momentum moves the
    parameters; weight decay applies), and the step counter advances.
    """

    def zero_step(state: TrainState):
        grads = jax.tree.map(jnp.zeros_like, trainable(state.params))
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        new = optax.apply_updates(trainable(state.params), updates)
        params = _with_trainable(state.params, new)
        zero = jnp.zeros((), jnp.float32)
        metrics = {
            "loss": zero,
            "pg_loss": zero,
            "grad_norm": zero,
            "param_norm": optax.tree.norm(params),
        }
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics

    if shardings is None:
        return jax.jit(zero_step, donate_argnums=(0,))
    return jax.jit(zero_step, donate_argnums=(0,), out_shardings=(shardings, None))


def make_logprob_fn(graphdef, temperature: float = 1.0, *, logits_chunk: int = 0):
    """Jitted `(params, tokens) -> (logprobs, entropies)` for scoring rollouts."""
    model_fn = make_model_fn(graphdef, logits_chunk=logits_chunk)
    return jax.jit(lambda params, tokens: token_logprobs(model_fn, params, tokens, temperature))
