"""The learner: losses, the jitted update step, and its host side.

May import: models, parallel.

Everything here is a pure function of arrays. A batch is a set of right-padded token
sequences (prompt + action) with a mask on the action tokens: the only tokens that are trained.

Shape suffixes: B sequences, L sequence length.

Modules, one role each: `batch` (padded batches), `losses` (log-probs, BC and PG losses),
`step` (train state, optimizer, the jitted update), `host` (examples, minibatches, `RLUpdater`).
"""

from bpo_jax.learner.batch import Batch, pad_batch
from bpo_jax.learner.host import (
    Example,
    RLUpdater,
    loss_denominator_of,
    minibatches,
    round_up,
    row_bucket,
)
from bpo_jax.learner.losses import (
    LOSS_AGGS,
    bc_loss,
    chunked_token_logprobs,
    loss_denominator,
    pg_loss,
    token_logprobs,
)
from bpo_jax.learner.step import (
    TrainState,
    full_reference,
    make_logprob_fn,
    make_model_fn,
    make_optimizer,
    make_train_step,
    reference_params,
    state_shardings,
    trainable,
)

__all__ = [
    "LOSS_AGGS",
    "Batch",
    "Example",
    "RLUpdater",
    "TrainState",
    "bc_loss",
    "chunked_token_logprobs",
    "full_reference",
    "loss_denominator",
    "loss_denominator_of",
    "make_logprob_fn",
    "make_model_fn",
    "make_optimizer",
    "make_train_step",
    "minibatches",
    "pad_batch",
    "pg_loss",
    "reference_params",
    "round_up",
    "row_bucket",
    "state_shardings",
    "token_logprobs",
    "trainable",
]
