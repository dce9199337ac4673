"""The compile tool's modes beyond the default report: a program that does not fit, the sampler
as a multi-host run places it (`--sampler=host`), and the prefill's attention bound."""

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
