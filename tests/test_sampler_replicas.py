"""The sampler's per-replica programs: rows split over a mesh's `data` axis decode on their own.

Runs in a fresh interpreter with 4 CPU devices (the device count must be set before JAX
initialises; pytest's process already has one device). The same prompts, keys and parameters
go through three layouts, two turns each (prefill, generate, append an observation, generate):
  * one program over the whole batch on one device (the reference);
  * rows over data=2, parameters replicated (what `bench/bench_sampler.py` runs on the CPU);
  * rows over data=2 and heads over tensor=2, under `jax.set_mesh` (the automatic tensor axis
    inside the per-replica program).
"""

import textwrap

import pytest
from helpers import run_script_result

_SCRIPT = textwrap.dedent(
    """
    import json, re

    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from bpo_jax import sampler as sampler_lib
    from bpo_jax.models import config, factory, sharding
    from bpo_jax.models.llama import init_cache

    cfg = config.tiny(max_seq_len=128, num_kv_heads=2)
    EOS = tuple(range(100, 200))  # a tenth of the vocabulary: rows stop at different steps

    def sharpen(params):  # as in test_sampler: context-dependent, non-uniform distributions
        def scale(path, x):
            name = jax.tree_util.keystr(path)
            if "embed_tokens" in name:
                return x * 4.0
            return x if ("norm" in name or "bias" in name) else x * 6.0
        return jax.tree.map_with_path(scale, params)

    rng = np.random.default_rng(0)
    lengths = [5, 17, 9, 30, 12, 3, 21, 8]
    prompts = [rng.integers(8, cfg.vocab_size, n).tolist() for n in lengths]
    replies = [rng.integers(8, cfg.vocab_size, n).tolist() for n in [4, 1, 6, 2, 9, 3, 5, 7]]
    keys = jnp.stack([jax.random.key(s) for s in range(8)])

    def episode(params, cache, sampler):
        state = sampler.prefill(params, cache, prompts)
        meshes = [sampler_lib.row_mesh(state.cache)]
        first = sampler.generate(params, state, keys)
        meshes.append(sampler_lib.row_mesh(first.state.cache))
        state = sampler.prefill(params, first.state, replies)
        meshes.append(sampler_lib.row_mesh(state.cache))
        second = sampler.generate(params, state, jax.random.key(3), max_new_tokens=9)
        meshes.append(sampler_lib.row_mesh(second.state.cache))
        outs = [
            {k: np.asarray(getattr(o, k)).tolist()
             for k in ("tokens", "logprobs", "entropies", "lengths", "stopped", "num_steps")}
            for o in (first, second)
        ]
        return outs, [None if m is None else dict(m.shape) for m in meshes]

    def new_sampler(graphdef):
        return sampler_lib.Sampler(graphdef, eos_ids=EOS, pad_id=0, max_new_tokens=12,
                                   temperature=0.7, length_bucket=16)

    out = {}
    model = factory.create_model(cfg, seed=0)
    graphdef, params = nnx.split(model)
    params = sharpen(params)
    ref_sampler = new_sampler(graphdef)
    out["reference"], out["reference_meshes"] = episode(
        params, init_cache(cfg, 8, 96), ref_sampler)

    # Rows over data=2, parameters replicated.
    mesh = sharding.make_mesh((2, 1, 1), devices=jax.devices()[:2])
    rep = jax.device_put(params, NamedSharding(mesh, P()))
    dp_sampler = new_sampler(graphdef)
    cache = init_cache(cfg, 8, 96, mesh=mesh)
    out["cache_spec"] = str(cache.k[0].sharding.spec)
    state = dp_sampler.prefill(rep, cache, prompts)
    lowered = dp_sampler.generate_fn(mesh).lower(
        rep, state.cache, state.last_logits, jax.random.key(0), jnp.float32(0.7),
        jnp.float32(1.0), num_new=12, greedy=False, nucleus=False)
    hlo = lowered.compile().as_text()
    out["collectives"] = sorted(set(re.findall(r"(all-gather|all-reduce|all-to-all|"
                                               r"collective-permute|reduce-scatter)", hlo)))
    out["all_reduces"] = len(re.findall(r"= [^ ]+ all-reduce\\(", hlo))
    out["data"], out["data_meshes"] = episode(rep, init_cache(cfg, 8, 96, mesh=mesh), dp_sampler)

    # An indivisible batch stays one program.
    odd = init_cache(cfg, 3, 96, mesh=mesh)
    out["odd_mesh"] = sampler_lib.row_mesh(odd) is None

    # Forks keep the rows split (when their number divides), and continue like the original.
    state = dp_sampler.prefill(rep, init_cache(cfg, 8, 96, mesh=mesh), prompts)
    ref_state = ref_sampler.prefill(params, init_cache(cfg, 8, 96), prompts)
    fork_rows = [3, 3, 0, 5]
    fork_keys = keys[:4]
    forks = {}
    sides = (("data", dp_sampler, state, rep), ("ref", ref_sampler, ref_state, params))
    for name, smp, st, w in sides:
        forked = smp.fork(st, fork_rows)
        forks[name + "_mesh"] = sampler_lib.row_mesh(forked.cache) is not None
        forks[name] = np.asarray(smp.generate(w, forked, fork_keys).logprobs).tolist()
        forks[name + "_odd_mesh"] = sampler_lib.row_mesh(smp.fork(st, [1, 2, 3]).cache) is not None
    out["forks"] = forks

    # Prefix reuse over data=2: the second turn continues the first turn's rows (copied and
    # cut to the shared head), stays split, and samples like a prefill from scratch.
    head = rng.integers(8, cfg.vocab_size, 24).tolist()
    turn = [head + p for p in prompts]
    prefixes = sampler_lib.PrefixCache(dp_sampler, lambda b: init_cache(cfg, b, 96, mesh=mesh))
    prefixes.prefill(rep, turn)
    turn2 = [head + r for r in replies]
    reused = prefixes.prefill(rep, turn2)
    ref_state = ref_sampler.prefill(params, init_cache(cfg, 8, 96), turn2)
    out["prefix"] = {
        "prefilled": reused.prefilled_b.tolist(),
        "mesh": sampler_lib.row_mesh(reused.cache) is not None,
        "logprobs": np.asarray(dp_sampler.generate(rep, reused, keys).logprobs).tolist(),
        "ref": np.asarray(ref_sampler.generate(params, ref_state, keys).logprobs).tolist(),
    }

    # Rows over data=2 and heads over tensor=2, under the mesh and its rules.
    mesh2 = sharding.make_mesh((2, 1, 2))
    with jax.set_mesh(mesh2):
        tp_model = factory.create_model(cfg, mesh=mesh2, seed=0)
        tp_graphdef, tp_params = nnx.split(tp_model)
        tp_params = sharpen(tp_params)
        out["qkv_spec"] = str(tp_params["layers"][0]["self_attn"]["qkv_proj"].get_value()
                              .sharding.spec)
        out["tensor"], out["tensor_meshes"] = episode(
            tp_params, init_cache(cfg, 8, 96, mesh=mesh2), new_sampler(tp_graphdef))
    print("RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def run():
    return run_script_result(_SCRIPT, timeout=600)


def _max_abs_diff(rows_a, rows_b) -> float:
    """The largest |a - b| between two lists of rows of the same shape."""
    return max(
        abs(a - b)
        for row_a, row_b in zip(rows_a, rows_b, strict=True)
        for a, b in zip(row_a, row_b, strict=True)
    )


def _assert_same_episode(got, want):
    for turn_got, turn_want in zip(got, want, strict=True):
        for key in ("tokens", "lengths", "stopped", "num_steps"):
            assert turn_got[key] == turn_want[key], key
        for key in ("logprobs", "entropies"):
            diff = _max_abs_diff(turn_got[key], turn_want[key])
            assert diff < 1e-4, (key, diff)


def test_reference_runs_one_program_and_rows_stop_unevenly(run):
    assert run["reference_meshes"] == [None] * 4
    first, second = run["reference"]
    # The eos token stops some rows early, so replicas finish after different step counts and
    # num_steps must be the longest of them.
    assert any(first["stopped"]) or any(second["stopped"])
    assert len(set(first["lengths"])) > 1 or len(set(second["lengths"])) > 1


def test_rows_over_data_decode_per_replica_like_one_program(run):
    assert run["cache_spec"].startswith("P(('data', 'fsdp')")
    data_mesh = {"data": 2, "fsdp": 1, "tensor": 1}
    # Every call keeps the rows split, so the next one is per replica too.
    assert run["data_meshes"] == [data_mesh] * 4
    _assert_same_episode(run["data"], run["reference"])


def test_per_replica_decode_has_no_collective_but_the_step_count(run):
    # The loop's exit test and cache writes need no communication; only the final step count
    # is reduced across replicas.
    assert run["collectives"] == ["all-reduce"]
    assert run["all_reduces"] == 1


def test_indivisible_batch_is_not_split(run):
    assert run["odd_mesh"]
    assert not run["forks"]["data_odd_mesh"]


def test_forks_stay_split_and_continue_like_one_program(run):
    forks = run["forks"]
    assert forks["data_mesh"] and not forks["ref_mesh"]
    diff = _max_abs_diff(forks["data"], forks["ref"])
    assert diff < 1e-4


def test_prefix_reuse_stays_split_and_samples_like_one_program(run):
    prefix = run["prefix"]
    # Only each reply runs: the 24-token head and nothing else is shared with the first turn.
    assert prefix["prefilled"] == [4, 1, 6, 2, 9, 3, 5, 7]
    assert prefix["mesh"]
    diff = _max_abs_diff(prefix["logprobs"], prefix["ref"])
    assert diff < 1e-4


def test_tensor_axis_stays_automatic_inside_replicas(run):
    assert "tensor" in run["qkv_spec"]
    assert run["tensor_meshes"] == [{"data": 2, "fsdp": 1, "tensor": 2}] * 4
    _assert_same_episode(run["tensor"], run["reference"])
