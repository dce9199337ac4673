"""`sharding.make_mesh` on real TPU topologies (libtpu's compile-only devices) and on CPUs.

One slice: the mesh follows the ICI torus (`mesh_utils.create_device_mesh`). Several slices
(multislice): the data axis runs over the slices (DCN) and fsdp/tensor stay inside each one.
Only meshes are built here; nothing is compiled.
"""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from libtpu_fixtures import require_libtpu

from bpo_jax import compile as compile_tool
from bpo_jax.models import sharding


def _devices(accelerator_type: str, num_slices: int = 1) -> list:
    require_libtpu()
    return compile_tool.topology_devices(compile_tool.parse_topology(accelerator_type), num_slices)


def _varying_coords(group) -> int:
    """How many physical coordinates vary over a group of devices."""
    coords = np.array([d.coords for d in group])
    return int((coords.max(axis=0) != coords.min(axis=0)).sum())


def test_one_slice_puts_each_tensor_group_on_one_physical_axis():
    """v5p-64 (2x4x4 chips), tensor=4: every tensor group is a line of 4 chips along one torus
    axis; the devices' flat order (hosts of 2x2 chips) would make each a 2x2 square."""
    devices = _devices("v5p-64")
    mesh = sharding.make_mesh({"fsdp": -1, "tensor": 4}, devices=devices)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 4}
    assert {d.id for d in mesh.devices.flat} == {d.id for d in devices}
    groups = mesh.devices.reshape(-1, 4)
    assert all(_varying_coords(g) == 1 for g in groups), [[d.coords for d in g] for g in groups]
    flat = np.asarray(devices, dtype=object).reshape(-1, 4)
    assert any(_varying_coords(g) > 1 for g in flat)  # What the flat order gave before.


@pytest.mark.parametrize("data", [1, 2])
def test_multislice_data_axis_groups_devices_by_slice(data):
    """Two v5p-16 slices (8 chips each): data = 2 x `data`, fsdp over each slice's chips."""
    devices = _devices("v5p-16", num_slices=2)
    assert sorted({d.slice_index for d in devices}) == [0, 1]
    mesh = sharding.make_mesh({"data": data, "fsdp": -1}, devices=devices)
    assert dict(mesh.shape) == {"data": 2 * data, "fsdp": 8 // data, "tensor": 1}
    slice_of = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    # Data rows [0, data) are slice 0's chips, [data, 2 data) slice 1's.
    for row in range(2 * data):
        assert set(slice_of[row].flat) == {row // data}, slice_of
    # Every fsdp (and tensor) group lies inside one slice: no parameter gather crosses DCN.
    for row in mesh.devices:
        assert len({d.slice_index for d in row.flat}) == 1
    assert {d.id for d in mesh.devices.flat} == {d.id for d in devices}
    # The explicit slice count is the same mesh.
    same = sharding.make_mesh({"data": data, "fsdp": -1}, devices=devices, dcn_data=2)
    assert (
        np.vectorize(lambda d: d.id)(same.devices) == np.vectorize(lambda d: d.id)(mesh.devices)
    ).all()


def test_multislice_tensor_axis_within_a_slice_over_v5e():
    """Two v5litepod-8 slices (2x4 chips): tensor=2 pairs chips of one slice."""
    devices = _devices("v5litepod-8", num_slices=2)
    mesh = sharding.make_mesh({"fsdp": -1, "tensor": 2}, devices=devices)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 2}
    for i in range(2):
        assert {d.slice_index for d in mesh.devices[i].flat} == {i}
    for pair in mesh.devices.reshape(-1, 2):
        assert pair[0].slice_index == pair[1].slice_index and _varying_coords(pair) == 1


@pytest.mark.parametrize(
    "shape, dcn_data, match",
    [
        # An fsdp axis over both slices' 16 chips would cross DCN.
        ({"fsdp": 16}, 0, r"needs 16 devices per slice \(2 slices\).*never cross slices"),
        ({"fsdp": 3, "tensor": -1}, 0, r"8 devices per slice .* cannot be split"),
        ({"fsdp": -1}, 3, r"dcn_data=3 .* span, 2"),
        ({"fsdp": -1}, 1, r"dcn_data=1 .* span, 2"),
    ],
)
def test_multislice_errors_name_the_problem(shape, dcn_data, match):
    devices = _devices("v5p-16", num_slices=2)
    with pytest.raises(ValueError, match=match):
        sharding.make_mesh(shape, devices=devices, dcn_data=dcn_data)


def test_unequal_slices_are_refused():
    devices = _devices("v5p-16", num_slices=2)
    with pytest.raises(ValueError, match="unequal size"):
        sharding.make_mesh({"fsdp": -1}, devices=devices[:12])


_CPU_SCRIPT = textwrap.dedent(
    """
    import json
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from bpo_jax.models import sharding

    out = {}
    for shape in [(2, 2, 2), (1, -1, 2), (8, 1, 1)]:
        mesh = sharding.make_mesh(shape)
        out[str(shape)] = {
            "shape": list(mesh.devices.shape),
            "same_order": [d.id for d in mesh.devices.flat] == [d.id for d in jax.devices()],
        }
    try:
        sharding.make_mesh((1, -1, 1), dcn_data=2)
    except ValueError as e:
        out["dcn_error"] = str(e)
    print(json.dumps(out))
    """
)


def test_cpu_devices_keep_their_order():
    """CPU devices have no topology: the mesh is the device list reshaped, as before."""
    proc = subprocess.run(
        [sys.executable, "-c", _CPU_SCRIPT], capture_output=True, text=True, check=True
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("dcn_error").startswith("dcn_data=2 (config.mesh.dcn_data) must be the number")
    assert out == {
        "(2, 2, 2)": {"shape": [2, 2, 2], "same_order": True},
        "(1, -1, 2)": {"shape": [1, 4, 2], "same_order": True},
        "(8, 1, 1)": {"shape": [8, 1, 1], "same_order": True},
    }
