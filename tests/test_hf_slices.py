"""The HF importer reads each device's slice from the safetensors files, and nothing else.

Parity: every parameter the slice reader builds is, bit for bit, what the whole-tensor mapping
(`tensor_map`'s `to_ours`, the importer's reference rearrangement) gives, on the tiny HF
checkpoints of `test_hf_parity` and for random slices of every parameter. Bytes: on 4 CPU
devices (a fresh interpreter, as the device count must be set before JAX starts), a sharded
load reads each checkpoint tensor exactly once in total, and the devices holding half of a
parameter read half of its bytes.
"""

import json
import os
import textwrap

import numpy as np
import pytest
import torch
from helpers import run_script_result
from safetensors.numpy import load_file
from test_hf_parity import CASES, _hf_model

from bpo_jax.models import hf_import
from bpo_jax.models.safetensors_slices import SafetensorsFile, read_region


def _reference(path, cfg):
    """Each parameter as today's whole-tensor mapping makes it: {path: array}."""
    tensors = load_file(os.path.join(path, "model.safetensors"))
    return {e.path: e.to_ours(*(tensors[n] for n in e.hf_names)) for e in hf_import.tensor_map(cfg)}


@pytest.fixture(scope="module", params=[*sorted(CASES), "qwen2_bf16"])
def checkpoint(request, tmp_path_factory):
    name = request.param
    hf = _hf_model(*CASES["qwen2_untied" if name == "qwen2_bf16" else name])
    if name == "qwen2_bf16":
        hf = hf.to(torch.bfloat16)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path, safe_serialization=True)
    return path


def test_loaded_parameters_equal_the_whole_tensor_mapping_bit_for_bit(checkpoint):
    cfg, model = hf_import.load_hf_checkpoint(checkpoint)
    from flax import nnx

    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for path, ref in _reference(checkpoint, cfg).items():
        got = np.asarray(flat[path].get_value())
        assert got.dtype == ref.dtype and got.shape == ref.shape, path
        assert got.tobytes() == np.ascontiguousarray(ref).tobytes(), path


def test_random_slices_equal_slices_of_the_whole_tensor_mapping(checkpoint):
    cfg = hf_import.config_from_hf(json.loads((checkpoint / "config.json").read_text()))
    reference = _reference(checkpoint, cfg)
    file = SafetensorsFile(checkpoint / "model.safetensors")
    rng = np.random.default_rng(0)
    try:
        for entry in hf_import.tensor_map(cfg):
            ref = reference[entry.path]
            for _ in range(6):
                index = []
                for n in ref.shape:
                    lo = int(rng.integers(0, n))
                    index.append(slice(lo, int(rng.integers(lo + 1, n + 1))))
                got = read_region(entry.pieces, entry.axis, index, file.tensors, file.read_block)
                want = ref[tuple(index)]
                assert got.shape == want.shape and got.tobytes() == want.tobytes(), (
                    entry.path,
                    index,
                )
    finally:
        file.close()


def test_a_slice_reads_only_its_rows_and_columns(checkpoint):
    """The embedding [V, D]: a block of rows is one read of exactly those rows; a narrow block
    of columns is one read per row of exactly those columns."""
    file = SafetensorsFile(checkpoint / "model.safetensors")
    try:
        info = file.tensors["model.embed_tokens.weight"]
        (v, d), item = info.shape, info.dtype.itemsize
        file.read_block("model.embed_tokens.weight", slice(10, 20), slice(0, d))
        assert file.bytes_read == 10 * d * item
        file.bytes_read = 0
        file.read_block("model.embed_tokens.weight", slice(0, v), slice(4, 8))
        assert file.bytes_read == v * 4 * item
    finally:
        file.close()


_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, tempfile
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax
    import numpy as np
    from flax import nnx
    from safetensors.numpy import save_file
    from bpo_jax.models import hf_import, sharding
    from bpo_jax.models.factory import abstract_model, param_specs
    from bpo_jax.models.safetensors_slices import SafetensorsFile

    hf_config = {
        "model_type": "qwen2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "tie_word_embeddings": False, "max_position_embeddings": 64, "dtype": "float32"}
    cfg = hf_import.config_from_hf(hf_config)
    rng = np.random.default_rng(0)
    entries = hf_import.tensor_map(cfg)
    tensors = {n: rng.standard_normal(s).astype(np.float32)
               for e in entries for n, s in zip(e.hf_names, e.hf_shapes)}
    tmp = tempfile.mkdtemp()
    file = os.path.join(tmp, "model.safetensors")
    save_file(tensors, file)
    _, abstract = nnx.split(abstract_model(cfg))
    flat_vars = dict(nnx.to_flat_state(abstract))
    out = {}

    def entry_reader(e, specs):  # Its shape and sharding in our model, and a fresh file.
        return flat_vars[e.path].get_value().shape, specs[e.path].get_value(), SafetensorsFile(file)

    for mesh_shape in [(1, 4, 1), (1, 2, 2)]:
        mesh = sharding.make_mesh(mesh_shape)
        specs = dict(nnx.to_flat_state(param_specs(abstract, mesh)))
        rows = {}
        for e in entries:
            shape, s, f = entry_reader(e, specs)
            value = hf_import.load_param(e, shape, np.float32, s, {n: f for n in e.hf_names})
            ref = e.to_ours(*(tensors[n] for n in e.hf_names))
            rows["/".join(map(str, e.path))] = {
                "equal": np.asarray(value).tobytes() == np.ascontiguousarray(ref).tobytes(),
                "read": f.bytes_read,
                "size": sum(tensors[n].nbytes for n in e.hf_names),
                "spec": str(s.spec),
            }
            f.close()
        out["x".join(map(str, mesh_shape))] = rows
    # One process of two, holding devices 0 and 1 of the fsdp=4 mesh: it reads half.
    mesh = sharding.make_mesh((1, 4, 1))
    specs = dict(nnx.to_flat_state(param_specs(abstract, mesh)))
    half = {}
    for e in entries:
        shape, s, f = entry_reader(e, specs)
        reader = hf_import.slice_reader(e, shape, np.float32, {n: f for n in e.hf_names})
        indices = s.devices_indices_map(tuple(shape))
        for device in list(mesh.devices.flat)[:2]:
            reader(indices[device])
        half["/".join(map(str, e.path))] = {"read": f.bytes_read, "spec": str(s.spec)}
        f.close()
    out["half"] = half
    print("RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def four_devices():
    return run_script_result(_SCRIPT, timeout=300)


@pytest.mark.parametrize("mesh", ["1x4x1", "1x2x2"])
def test_sharded_load_reads_every_tensor_once_in_total(four_devices, mesh):
    rows = four_devices[mesh]
    assert len(rows) == 10  # embed, 2 norms, qkv, qkv bias, o, gate_up, down, norm, lm_head
    assert any("fsdp" in r["spec"] for r in rows.values())
    for name, r in rows.items():
        assert r["equal"], name
        assert r["read"] == r["size"], (name, r)  # Not once per device.


def test_devices_holding_half_a_parameter_read_half_of_it(four_devices):
    full = four_devices["1x4x1"]
    for name, r in four_devices["half"].items():
        if "fsdp" in r["spec"]:  # Split in four over fsdp: two devices hold half.
            assert r["read"] * 2 == full[name]["size"], (name, r)
        else:  # Replicated over fsdp (the qkv bias): every device holds all of it.
            assert r["read"] == full[name]["size"], (name, r)
