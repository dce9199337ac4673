"""The compile-only tool: real programs compiled for libtpu's compile-only TPU topologies."""

import pytest
from helpers import compile_report
from libtpu_fixtures import require_libtpu

from bpo_jax import compile as compile_tool
from bpo_jax.experiment import load_experiment

PROGRAMS = ("update", "prefill", "suffix", "decode")
FIELDS = (
    "argument_bytes",
    "temp_bytes",
    "total_bytes",
    "fits",
    "flops",
    "model_flops",
    "bytes_accessed",
    "roofline_seconds",
)


@pytest.mark.parametrize(
    "name, chips, topology, hbm_gib",
    [
        ("v4-32", 16, "v4:2x2x4", 32),
        ("v5p-64", 32, "v5p:2x4x4", 95),
        ("v5p-128", 64, "v5p:4x4x4", 95),
        ("v5litepod-64", 64, "v5e:8x8", 16),
        ("v5litepod-16", 16, "v5e:4x4", 16),
        ("v6e-64", 64, "v6e:8x8", 32),
    ],
)
def test_gcloud_names_map_to_chips_and_topologies(name, chips, topology, hbm_gib):
    s = compile_tool.parse_topology(name)
    assert (s.chips, s.topology_name, s.chip.hbm_bytes) == (chips, topology, hbm_gib << 30)


@pytest.mark.parametrize("bad", ["v5p-63", "v5p-7", "tpu-64", "v5litepod-3"])
def test_unknown_accelerator_types_are_refused(bad):
    with pytest.raises(ValueError, match="v5p|v4|known sizes"):
        compile_tool.parse_topology(bad)


@pytest.mark.slow  # Minutes on 2 cores: CI's slow phase (the default suite stays short).
def test_compile_tool_on_a_small_topology_writes_the_report(tmp_path):
    """The tiny ALFWorld setting compiled for a v5e-16 slice (16 compile-only chips)."""
    require_libtpu()
    rc, report = compile_report(
        tmp_path, "--topology=v5litepod-16", f"--programs={','.join(PROGRAMS)}"
    )
    assert rc == 0
    assert report["topology"] == "v5litepod-16"
    assert report["num_slices"] == 1
    assert report["chips"] == 16
    assert report["hbm_bytes_per_chip"] == 16 << 30
    assert set(report["programs"]) == set(PROGRAMS)
    for name, p in report["programs"].items():
        assert set(p) == set(FIELDS), name
        assert p["fits"] is True, name
        for field in FIELDS[:3] + FIELDS[4:]:
            assert p[field] > 0, (name, field, p[field])
        assert p["total_bytes"] >= p["temp_bytes"], name
        assert p["total_bytes"] < report["hbm_bytes_per_chip"]
    # The update does more work than the prefill, which does more than a decode loop's body.
    progs = report["programs"]
    assert progs["update"]["model_flops"] > progs["prefill"]["model_flops"]
    assert progs["update"]["flops"] > progs["prefill"]["flops"] > progs["decode"]["flops"]
    # A later turn with prefix reuse prefills a quarter of the longest prompt after the rest.
    prefix, new = compile_tool.turn_shape(compile_tool.validate_for_compile(load_cpu()))
    assert report["turn"]["prefix_tokens"] == prefix and report["turn"]["new_tokens"] == new
    assert progs["suffix"]["model_flops"] < progs["prefill"]["model_flops"] / 2
    assert progs["suffix"]["flops"] < progs["prefill"]["flops"]
    turn = report["turn"]
    assert turn["roofline_seconds"] == pytest.approx(
        progs["suffix"]["roofline_seconds"] + progs["decode"]["roofline_seconds"]
    )
    assert turn["roofline_seconds"] < turn["roofline_seconds_no_reuse"]


def load_cpu():
    return load_experiment("experiments/alfworld.py").get_config("cpu")


@pytest.mark.slow
@pytest.mark.full_compile  # Deselected by default (pyproject addopts): -m full_compile runs it.
@pytest.mark.parametrize("topology", ["v5p-64", "v5litepod-64"])
@pytest.mark.parametrize("model", ["qwen2_5_7b", "llama3_1_8b"])
@pytest.mark.parametrize("experiment", ["alfworld", "webshop", "swebench"])
def test_full_settings_fit(experiment, model, topology):
    """The paper settings (their real minibatch and sequence lengths) fit the slices' HBM."""
    require_libtpu()
    raw = load_experiment(f"experiments/{experiment}.py").get_config(f"model={model}")
    cfg = compile_tool.validate_for_compile(raw)
    report = compile_tool.compile_report(cfg, topology)
    print(compile_tool.format_report(report))
    for name, p in report["programs"].items():
        assert p["fits"], (name, p.get("error"), p["total_bytes"], p["temp_bytes"])


@pytest.mark.slow  # 6 min measured on this loaded 2-core machine.
def test_compile_tool_multislice_runs_data_over_the_slices(tmp_path):
    """`--num_slices=2` of v5litepod-4: 8 chips, the data axis over the two slices (DCN)."""
    require_libtpu()
    rc, report = compile_report(
        tmp_path, "--topology=v5litepod-4", "--num_slices=2", "--programs=update"
    )
    assert rc == 0
    assert (report["num_slices"], report["chips"]) == (2, 8)
    assert report["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}
    assert set(report["programs"]) == {"update"}
    assert report["programs"]["update"]["fits"] is True
