"""`distributed.to_local` in two processes (gloo over 127.0.0.1, 2 CPU devices each).

The parameters of a global fsdp=4 mesh (two devices per process) become each process's own
fsdp=2 arrays with the same values, and no device receives more than its block of the local
layout on the way (the reshard program's output per device is that block, with no temporary
the size of a whole parameter).
"""

import json
import sys
import textwrap

from helpers import free_port, run_together

_WORKER = textwrap.dedent(
    """
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from bpo_jax.parallel import distributed
    from bpo_jax.models import sharding

    distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
    mesh = sharding.make_mesh((1, -1, 1))  # fsdp=4 over both processes' devices.
    shapes = {"w": ((8, 6), P("fsdp", None)), "v": ((6, 8), P(None, "fsdp")), "b": ((6,), P())}
    values = {k: np.arange(np.prod(s), dtype=np.float32).reshape(s) for k, (s, _) in shapes.items()}
    tree = {
        k: jax.make_array_from_callback(s, NamedSharding(mesh, spec), lambda i, k=k: values[k][i])
        for k, (s, spec) in shapes.items()
    }
    local_mesh = distributed.local_mesh(mesh)
    staging = distributed.staging_mesh(mesh, local_mesh)
    out = {"local_mesh": dict(local_mesh.shape), "staging_mesh": dict(staging.shape), "leaves": {}}
    # The reshard `to_local` makes, compiled on its own: per device, its output is the block.
    w_staged = NamedSharding(staging, P("fsdp", None))
    mem = jax.jit(lambda x: x, out_shardings=w_staged).lower(tree["w"]).compile().memory_analysis()
    out["w_reshard"] = {"output": mem.output_size_in_bytes, "temp": mem.temp_size_in_bytes}
    local = distributed.to_local(tree, local_mesh)
    for k, x in local.items():
        out["leaves"][k] = {
            "addressable": x.is_fully_addressable,
            "on_local_mesh": x.sharding.mesh == local_mesh,
            "spec": str(x.sharding.spec),
            "shard": list(x.addressable_shards[0].data.shape),
            "equal": bool(np.array_equal(np.asarray(x), values[k])),
        }
    # A global mesh whose device order interleaves the processes (as a TPU torus order may):
    # the staging mesh's order differs from it, and the reshard reorders the shards first.
    from jax.sharding import Mesh
    devs = np.asarray(jax.devices(), dtype=object)[[0, 2, 1, 3]].reshape(1, 4, 1)
    mixed = Mesh(devs, sharding.MESH_AXES, axis_types=mesh.axis_types)
    w = jax.make_array_from_callback((8, 6), NamedSharding(mixed, P("fsdp", None)),
                                     lambda i: values["w"][i])
    w_local = distributed.to_local({"w": w}, distributed.local_mesh(mixed))["w"]
    out["mixed_order"] = {"equal": bool(np.array_equal(np.asarray(w_local), values["w"])),
                          "shard": list(w_local.addressable_shards[0].data.shape)}
    print("RESULT", json.dumps(out), flush=True)
    """
)


def test_to_local_reshards_each_process_s_block_only():
    address = f"127.0.0.1:{free_port()}"
    procs, outs = run_together(
        [[sys.executable, "-c", _WORKER, address, str(i)] for i in range(2)], timeout=600
    )
    results = []
    for p, text in zip(procs, outs):
        assert p.returncode == 0, text[-5000:]
        line = next(ln for ln in text.splitlines() if ln.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT ") :]))
    for r in results:
        assert r["local_mesh"] == {"data": 1, "fsdp": 2, "tensor": 1}
        assert r["staging_mesh"] == {"process": 2, "data": 1, "fsdp": 2, "tensor": 1}
        # w is 8 x 6 float32 = 192 bytes; a device's block of the local layout is half of it.
        assert r["w_reshard"]["output"] == 96, r["w_reshard"]
        assert r["w_reshard"]["temp"] < 192, r["w_reshard"]
        leaves = r["leaves"]
        for k, leaf in leaves.items():
            assert leaf["addressable"] and leaf["on_local_mesh"] and leaf["equal"], (k, leaf)
        assert (leaves["w"]["spec"], leaves["w"]["shard"]) == (
            "P('fsdp', None)",
            [4, 6],
        )
        assert (leaves["v"]["spec"], leaves["v"]["shard"]) == (
            "P(None, 'fsdp')",
            [6, 4],
        )
        assert leaves["b"]["shard"] == [6]
        assert r["mixed_order"] == {"equal": True, "shard": [4, 6]}
