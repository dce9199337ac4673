"""Orbax checkpoints of the whole training state, so an interrupted run resumes where it stopped.

Each step directory holds two items: `state`, an arbitrary pytree of arrays (Flax NNX state,
optax optimizer state, step counters, PRNG keys) written with Orbax's standard handler, and
`meta`, a small JSON dict (config snapshot, data-loader position, wall time).

PRNG keys: typed keys (`jax.random.key`) are stored as their raw uint32 key data
(`jax.random.key_data`) so the files do not depend on Orbax's typed-key support. Restoring with
an `abstract_state` whose leaf has a key dtype wraps the data back into a typed key of the same
implementation; restoring without one returns the uint32 data. Legacy raw uint32 keys
(`jax.random.PRNGKey`) are ordinary arrays and round-trip unchanged.

Typical resume:

  ckpt = Checkpointer(workdir / "checkpoints")
  state = init_state()  # fresh model/optimizer, already sharded
  if ckpt.latest_step() is not None:
    step, state, meta = ckpt.restore(abstract_state=abstract_like(state))
  ...
  ckpt.save(step, state, meta={"episodes_seen": n})
  ckpt.close()
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import NamedSharding, SingleDeviceSharding

from bpo_jax.io import files

PyTree = Any

_log = logging.getLogger(__name__)

# TensorStore / OCDBT status codes and phrases of a file that is truncated or garbled (as
# opposed to a tree that does not match the abstract state).
_DAMAGE = re.compile(r"DATA_LOSS|OUT_OF_RANGE|Error decoding|Error reading|not valid for value")


class CheckpointDamagedError(ValueError):
    """A checkpoint step whose files cannot be read (truncated, garbled); names step and file."""

    def __init__(self, step: int, directory: epath.Path, file: str, cause: str):
        self.step, self.file = step, file
        super().__init__(f"checkpoint step {step} in {directory} is damaged ({file}: {cause})")


def _causes(e: BaseException):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def _first_line(text: str, limit: int = 300) -> str:
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _damage(step_dir: epath.Path, error: BaseException) -> tuple[str, str] | None:
    """(file, one-line cause) when `error` comes from damaged files, else None."""
    chain = list(_causes(error))
    decode = next((c for c in chain if isinstance(c, json.JSONDecodeError)), None)
    store = next((c for c in chain if _DAMAGE.search(str(c))), None)
    if decode is None and store is None:
        return None
    if decode is not None:
        # Orbax does not say which JSON file it was reading: find the one that does not parse.
        for path in files.iter_files(step_dir):
            if not path.name.endswith(".ocdbt") and "/d/" not in str(path):
                try:
                    json.loads(path.read_bytes() or b"null")
                except (ValueError, UnicodeDecodeError):
                    return str(path.relative_to(step_dir)), _first_line(decode)
        return "a metadata file", _first_line(decode)
    message = str(store)
    m = re.search(r'Error reading "([^"]+)" in OCDBT database', message) or re.search(
        r'local file "([^"]+)"', message
    )
    what = f"array {m.group(1)!r}" if m and "Error reading" in m.group(0) else "state files"
    cause = re.search(r"(OUT_OF_RANGE|DATA_LOSS)[^\n]*", message)
    return what, _first_line(cause.group(0) if cause else message)


def _is_typed_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def to_checkpointable(tree: PyTree) -> PyTree:
    """Replaces typed PRNG keys with their uint32 key data; other leaves pass through.

    nnx.State, optax states (namedtuples), dicts, Python scalars and arrays need no conversion:
    Orbax saves any pytree of those.

    Args:
      tree: The training state.

    Returns:
      The same structure with typed keys turned into uint32 arrays.
    """
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_typed_key(x) else x, tree)


def _key_info(leaf: Any) -> tuple[Any, jax.ShapeDtypeStruct]:
    """(PRNG implementation, abstract key data) for a typed-key array or ShapeDtypeStruct."""
    found = []

    def probe(key):
        # `key_impl` only accepts arrays, so read it from a tracer of the abstract key.
        found.append(jax.random.key_impl(key))
        return jax.random.key_data(key)

    data = jax.eval_shape(probe, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    return found[0], data


def _key_data_sharding(sharding: Any, key_shape: tuple[int, ...]) -> Any:
    """The sharding for key data: the key's own, with the trailing key dimension replicated."""
    if sharding is None or isinstance(sharding, SingleDeviceSharding):
        return sharding
    if isinstance(sharding, NamedSharding):
        # A PartitionSpec shorter than the rank leaves the remaining dimensions replicated.
        return NamedSharding(sharding.mesh, sharding.spec, memory_kind=sharding.memory_kind)
    raise ValueError(
        f"cannot restore a typed PRNG key of shape {key_shape} with sharding {sharding!r}; give "
        "key leaves a NamedSharding or SingleDeviceSharding in abstract_state."
    )


def _storage_abstract(abstract_state: PyTree) -> PyTree:
    """Turns typed-key leaves of an abstract state into the uint32 layout they are stored in."""

    def convert(leaf):
        if not _is_typed_key(leaf):
            return leaf
        _, data = _key_info(leaf)
        sharding = _key_data_sharding(getattr(leaf, "sharding", None), tuple(leaf.shape))
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)

    return jax.tree.map(convert, abstract_state)


def from_checkpointable(tree: PyTree, abstract_state: PyTree) -> PyTree:
    """Undoes `to_checkpointable`: wraps key data back into typed keys where the abstract has them.

    Args:
      tree: A restored state, with the structure of `abstract_state`.
      abstract_state: The target tree (ShapeDtypeStructs or arrays); its typed-key leaves say
        which restored leaves are key data and which PRNG implementation they use.

    Returns:
      `tree` with typed keys restored.
    """

    def convert(abstract_leaf, leaf):
        if not _is_typed_key(abstract_leaf) or _is_typed_key(leaf):
            return leaf
        impl, _ = _key_info(abstract_leaf)
        return jax.random.wrap_key_data(leaf, impl=impl)

    return jax.tree.map(convert, abstract_state, tree)


def abstract_like(tree: PyTree) -> PyTree:
    """ShapeDtypeStructs (keeping each array's sharding) for the JAX arrays in `tree`.

    Use it on a freshly initialised, already sharded state to restore a checkpoint into the
    same layout. Non-JAX leaves (Python scalars, NumPy arrays) are kept as they are; Orbax
    restores them as the same kind of value.

    Args:
      tree: A pytree of arrays and scalars.

    Returns:
      The abstract tree.
    """

    def convert(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(convert, tree)


class Checkpointer(files.Closeable):
    """Saves and restores `(step, state, meta)` with an Orbax `CheckpointManager`.

    Saves are asynchronous: `save` returns once the arrays are copied off the accelerator, so
    the caller may keep training (and donate buffers) while files are written. Call `wait()`
    before reading the files from elsewhere, and `close()` at the end of the run.

    Args:
      directory: Where step subdirectories go: a local folder (made absolute) or a bucket URL
        (`gs://...`, kept as it is; see `bpo_jax.io.files`). It is created on the first
        save, not here, so a mistyped path given only for restoring fails loudly.
      max_to_keep: How many most recent checkpoints to keep; None keeps all.
      save_interval_steps: `save` writes steps that are multiples of this. Orbax also always
        writes the first save into an empty directory, and any step once a preemption signal
        has been received (multi-host runs), so a short or preempted run still leaves one.
      async_save: Write in a background thread. Turn off to make `save` blocking.

    Raises:
      ValueError: If `max_to_keep` or `save_interval_steps` is not positive.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        *,
        async_save: bool = True,
    ):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None (keep all), got {max_to_keep}.")
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}.")
        self.directory = files.as_path(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            create=False,
            # Half-written step directories from a killed run are removed rather than restored.
            cleanup_tmp_directories=True,
            enable_async_checkpointing=async_save,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def all_steps(self) -> list[int]:
        """The saved steps, ascending (including one an async save is still writing)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest saved step, or None when there is none."""
        return self._manager.latest_step()

    def save(
        self, step: int, state_tree: PyTree, meta: dict[str, Any] | None = None, force: bool = False
    ) -> bool:
        """Saves the state for `step` if the save interval allows it (or `force`).

        Args:
          step: The training step; must be newer than every saved step.
          state_tree: Any pytree of arrays and scalars (nnx.State, optax state, typed keys).
          meta: A JSON-serialisable dict stored beside the state.
          force: Save even if `step` is not a multiple of `save_interval_steps`.

        Returns:
          Whether a checkpoint was started. False when the interval skips this step, or when
          `step` is not newer than the latest checkpoint (logged: a run resumed from step N that
          saves N again writes nothing).

        Raises:
          TypeError: If `meta` is not a JSON-serialisable dict.
        """
        step = int(step)
        meta = {} if meta is None else meta
        if not isinstance(meta, dict):
            raise TypeError(f"meta must be a dict, got {type(meta).__name__}.")
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"meta must be JSON-serialisable ({e}); convert arrays with .tolist() or float()."
            ) from e
        latest = self.latest_step()
        if latest is not None and step <= latest:
            _log.warning(
                "Not saving step %d to %s: the latest checkpoint is step %d.",
                step,
                self.directory,
                latest,
            )
            return False
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(to_checkpointable(state_tree)),
            meta=ocp.args.JsonSave(meta),
        )
        return bool(self._manager.save(step, args=args, force=force))

    def restore(
        self, step: int | None = None, abstract_state: PyTree | None = None
    ) -> tuple[int, PyTree, dict[str, Any]]:
        """Restores a checkpoint.

        Args:
          step: Which step; None means the latest.
          abstract_state: The target tree, e.g. `abstract_like(fresh_state)` or
            `jax.eval_shape(init_fn)` with shardings attached. Arrays come back with its shapes,
            dtypes and shardings, nnx.State/namedtuple containers are rebuilt, and typed-key
            leaves become typed keys again. Without it, the saved tree comes back as nested
            dicts/lists of arrays on the default device, with keys as uint32 key data.

        Returns:
          (step, state, meta).

        Raises:
          FileNotFoundError: If the directory or the requested step does not exist.
          ValueError: If `abstract_state` does not match the saved tree.
        """
        # A save still in flight would otherwise be invisible or half-written.
        self.wait()
        if not self.directory.is_dir():
            raise FileNotFoundError(
                f"checkpoint directory {self.directory} does not exist; check the path, or start "
                "a fresh run without restoring."
            )
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(
                    f"no checkpoints in {self.directory}; check latest_step() before restoring."
                )
            step = steps[-1]
        elif int(step) not in steps:
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self.directory}; available steps: {steps}."
            )
        step = int(step)
        if abstract_state is None:
            state_args = ocp.args.StandardRestore()
        else:
            state_args = ocp.args.StandardRestore(_storage_abstract(abstract_state))
        args = ocp.args.Composite(state=state_args, meta=ocp.args.JsonRestore())
        try:
            restored = self._manager.restore(step, args=args)
        except Exception as e:  # Orbax raises bare Exceptions for TensorStore read errors.
            damage = _damage(self.directory / str(step), e)
            if damage is not None:
                raise CheckpointDamagedError(step, self.directory, *damage) from None
            if not isinstance(e, ValueError):
                raise
            raise ValueError(
                f"checkpoint step {step} in {self.directory} does not match abstract_state: {e}"
            ) from e
        state = restored.state
        if abstract_state is not None:
            state = from_checkpointable(state, abstract_state)
        return step, state, dict(restored.meta or {})

    def restore_intact(self, abstract_state: PyTree) -> tuple[int, PyTree, dict[str, Any]]:
        """Restores the newest step whose files can be read, setting damaged newer ones aside.

        A damaged step (`CheckpointDamagedError`) is reported in one line, naming the step and
        the file, and moved to `<directory>_damaged/<step>` (kept for inspection, and out of
        the way of the run's next saves); the step before it is tried next. A step that does
        not match `abstract_state` is not damage: that error is raised at once.

        Raises:
          FileNotFoundError: no checkpoint at all.
          CheckpointDamagedError: every step is damaged (the newest one's error).
        """
        self.wait()
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoints in {self.directory}.")
        first_error = None
        for step in reversed(steps):
            try:
                return self.restore(step, abstract_state)
            except CheckpointDamagedError as e:
                _log.warning("%s; trying the previous step.", e)
                first_error = first_error or e
                self._set_aside(step)
        raise first_error

    def _set_aside(self, step: int) -> None:
        target = self.directory.parent / f"{self.directory.name}_damaged" / str(step)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            target.rmtree()
        source = self.directory / str(step)
        if files.is_remote(source):  # A bucket renames object by object: copy, then delete.
            for path in files.iter_files(source):
                files.copy(path, target / path.relative_to(source))
            source.rmtree()
        else:
            shutil.move(source, target)
        self._manager.reload()

    def wait(self) -> None:
        """Blocks until every asynchronous save has finished writing."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager's resources."""
        self._manager.wait_until_finished()
        self._manager.close()
