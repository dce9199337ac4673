"""The compile tool's modes beyond the default report: a program that does not fit, the sampler
as a multi-host run places it (`--sampler=host`), and the prefill's attention bound."""

import dataclasses

import pytest
from helpers import compile_report
from libtpu_fixtures import require_libtpu

from bpo_jax import compile as compile_tool
from bpo_jax.experiment import load_experiment

XLA_OOM = (
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
    "temporaries (18.21G) exceeds available HBM (15.75G)."
)


def test_a_program_xla_refuses_is_reported_as_not_fitting():
    p = compile_tool.out_of_memory(RuntimeError(XLA_OOM + "\nmore detail"), 3.0)
    assert p["fits"] is False
    assert p["temp_bytes"] == int(18.21 * 2**30)
    assert p["argument_bytes"] is None and p["total_bytes"] is None
    assert p["model_flops"] == 3.0
    assert p["error"] == XLA_OOM
    report = {
        "num_slices": 1,
        "topology": "v5litepod-64",
        "chips": 64,
        "hbm_bytes_per_chip": 16 << 30,
        "mesh": {"data": 1, "fsdp": 64, "tensor": 1},
        "programs": {"prefill": p},
    }
    assert "prefill  does NOT fit: RESOURCE_EXHAUSTED" in compile_tool.format_report(report)


def _report(programs: dict) -> dict:
    return {
        "num_slices": 1,
        "topology": "v5litepod-8",
        "chips": 8,
        "hbm_bytes_per_chip": 16 << 30,
        "mesh": {"data": 1, "fsdp": 8, "tensor": 1},
        "programs": programs,
    }


def _fits_below(field: str, limit: int):
    """A stand-in for a compile: fits when the config's `field` is at most `limit`, with bytes
    that grow with it (the search's own logic is what these tests check; the real compiles are
    in bench/results/compile_alfworld_qwen3_8b_lora16_v5litepod-8_fit.json)."""
    calls = []

    def compile_at(cfg):
        section, name = field.split(".")
        value = getattr(getattr(cfg, section), name)
        calls.append(value)
        return {
            "fits": value <= limit,
            "argument_bytes": value << 23,
            "temp_bytes": value << 23,
            "total_bytes": value << 24,
            "flops": 1e12,
            "model_flops": 1e12,
            "bytes_accessed": 1e9,
            "roofline_seconds": 1.0,
        }

    return compile_at, calls


def test_fit_search_halves_the_microbatch_and_the_prefill_chunk_until_they_fit():
    cfg = compile_tool.validate_for_compile(
        load_experiment("experiments/alfworld.py").get_config("model=qwen3_8b")
    )
    t = cfg.train
    first = compile_tool.out_of_memory(RuntimeError(XLA_OOM), 1e12)
    compile_at, calls = _fits_below("train.microbatch_size", 16)
    p = compile_tool.fit_search("update", cfg, first, compile_at, row_devices=8)
    assert calls == [t.microbatch_size // 2, t.microbatch_size // 4] == [32, 16]
    assert p["fits"] and p["setting"] == {"train.microbatch_size": 16}
    assert [x["setting"]["train.microbatch_size"] for x in p["tried"]] == [64, 32]
    text = compile_tool.format_report(_report({"update": p}))
    assert "update: fits at --config.train.microbatch_size=16 (tried " in text
    assert "train.microbatch_size=64: does NOT fit, 18.21 GiB of temporaries" in text
    assert text.splitlines()[-1] == "fits with --config.train.microbatch_size=16"
    # Never below the devices the rows split over, nor to a size that does not divide the
    # minibatch: nothing fits, and the first report comes back with what was tried.
    compile_at, calls = _fits_below("train.microbatch_size", 4)
    p = compile_tool.fit_search("update", cfg, first, compile_at, row_devices=8)
    assert calls == [32, 16, 8] and not p["fits"] and "setting" not in p
    assert "update: no halving fits (tried" in compile_tool.format_report(_report({"update": p}))
    # The prefill: the chunk halves from the whole (bucketed) prompt, in length buckets.
    prompt = compile_tool.prefill_width(cfg)
    assert prompt == 2048 and compile_tool.prefill_calls(cfg) == 1
    compile_at, calls = _fits_below("sampler.prefill_chunk", 512)
    p = compile_tool.fit_search("prefill", cfg, first, compile_at)
    assert calls == [1024, 512] and p["setting"] == {"sampler.prefill_chunk": 512}
    chunked = dataclasses.replace(cfg, sampler=dataclasses.replace(cfg.sampler, prefill_chunk=512))
    assert compile_tool.prefill_width(chunked) == 512 and compile_tool.prefill_calls(chunked) == 4
    # A prompt of 1,600 columns (25 buckets of 64): the chunks stay whole buckets (768, 384).
    odd = dataclasses.replace(cfg, agent=dataclasses.replace(cfg.agent, max_prompt_tokens=1600))
    compile_at, calls = _fits_below("sampler.prefill_chunk", 512)
    p = compile_tool.fit_search("prefill", odd, first, compile_at)
    assert calls == [768, 384] and p["setting"] == {"sampler.prefill_chunk": 384}
    # The decode's rows and cache are the experiment's: nothing to halve.
    assert compile_tool.fit_search("decode", cfg, first, compile_at)["tried"] == []


def test_rollout_rows_per_host_are_the_host_s_share_of_the_tasks():
    cfg = compile_tool.validate_for_compile(
        load_experiment("experiments/swebench.py").get_config("model=qwen2_5_7b")
    )
    assert compile_tool.rollout_rows(cfg) == 16 * 8
    assert compile_tool.rollout_rows(cfg, 16) == 8  # v5litepod-64: 16 hosts, a task each.
    assert compile_tool.rollout_rows(cfg, 8) == 16  # v5p-64: 8 hosts.
    assert compile_tool.rollout_rows(cfg, 32) == 8  # More hosts than tasks: a task at most.


def test_unknown_modes_are_refused():
    cfg = compile_tool.validate_for_compile(
        load_experiment("experiments/alfworld.py").get_config("cpu")
    )
    with pytest.raises(ValueError, match="sampler must be"):
        compile_tool.compile_report(cfg, "v5litepod-16", ("decode",), sampler="pod")
    with pytest.raises(ValueError, match="prefill_bound must be"):
        compile_tool.lower_sampler(cfg, None, None, prefill_bound="half")
    longest = cfg.agent.max_prompt_tokens
    with pytest.raises(ValueError, match="prefix must lie in"):
        compile_tool.turn_shape(cfg, longest)
    assert compile_tool.turn_shape(cfg, longest - 1)[1] == cfg.sampler.length_bucket
    with pytest.raises(ValueError, match=r"--programs: unknown \['turn'\]"):
        compile_tool.main(["compile", "--config=experiments/alfworld.py:cpu", "--programs=turn"])


@pytest.mark.slow  # Compiles the tiny setting's prefill and decode: a minute or two on 2 cores.
def test_host_sampler_with_the_sampler_s_bound_compiles_on_one_host(tmp_path):
    """The tiny ALFWorld setting on v5p-32 (16 chips, 4 hosts of 4), sampled per host.

    Not on v5e: XLA refuses a program over some of a v5e slice's chips ("On platforms with
    limited ICI routing device assignment should include all slice devices").
    """
    require_libtpu()
    host = ["--sampler=host", "--prefill_bound=capacity"]
    rc, report = compile_report(tmp_path, "--topology=v5p-32", "--programs=prefill,decode", *host)
    assert rc == 0
    assert report["prefill_bound"] == "capacity"
    # 4 tasks x 4 rollouts over 4 hosts: one task, 4 rows, on a host's 4 chips.
    assert report["sampler"]["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert report["sampler"]["rows"] == 4
    resident = report["sampler"]["resident_bytes"]
    assert resident > 0
    for name in ("prefill", "decode"):
        p = report["programs"][name]
        assert p["fits"] is True, name
        assert p["resident_bytes"] == resident
        assert p["total_bytes"] >= p["argument_bytes"] + p["temp_bytes"] + resident
    assert set(report["wall_seconds"]) == {"lower", "prefill", "decode"}
