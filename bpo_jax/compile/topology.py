"""TPU generations, gcloud's slice names, and libtpu's compile-only devices of a slice."""

from __future__ import annotations

import dataclasses
import os
import re

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation as libtpu and gcloud name it, with the facts a roofline needs.

    `cores_in_name`: TensorCores per chip counted by gcloud's accelerator-type suffix (v4 and
    v5p count cores, so v5p-64 is 32 chips; v5e and v6e count chips).
    """

    libtpu_name: str
    gcloud_prefix: str
    cores_in_name: int
    chip_config: str  # libtpu's chip config: one device per chip.
    hbm_bytes: int
    peak_bf16_flops: float
    hbm_bytes_per_s: float
    topologies: dict[int, str]  # chips -> libtpu topology


_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8"}
_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}

# Chip facts from Google Cloud's TPU system-architecture pages (cloud.google.com/tpu/docs/v4,
# /v5p, /v5e, /v6e), per chip: v4 32 GiB HBM2, 275 TFLOP/s bf16, 1,200 GB/s; v5p 95 GiB HBM2e,
# 459 TFLOP/s bf16, 2,765 GB/s; v5e 16 GiB HBM2, 197 TFLOP/s bf16, 819 GB/s; v6e (Trillium)
# 32 GiB HBM, 918 TFLOP/s bf16, 1,640 GB/s.
CHIPS = {
    "v4": Chip("v4", "v4", 2, "megacore", 32 * GiB, 275e12, 1200e9, _3D),
    "v5p": Chip("v5p", "v5p", 2, "default", 95 * GiB, 459e12, 2765e9, _3D),
    "v5e": Chip("v5e", "v5litepod", 1, "default", 16 * GiB, 197e12, 819e9, _2D),
    "v6e": Chip("v6e", "v6e", 1, "default", 32 * GiB, 918e12, 1640e9, _2D),
}


@dataclasses.dataclass(frozen=True)
class Slice:
    accelerator_type: str
    chip: Chip
    chips: int

    @property
    def topology_name(self) -> str:
        return f"{self.chip.libtpu_name}:{self.chip.topologies[self.chips]}"


def parse_topology(accelerator_type: str) -> Slice:
    """A gcloud accelerator type (`v4-32`, `v5p-64`, `v5litepod-64`, `v6e-64`) as a `Slice`."""
    m = re.fullmatch(r"(v4|v5p|v5litepod|v5e|v6e)-(\d+)", accelerator_type)
    if m is None:
        raise ValueError(
            f"Unknown TPU accelerator type {accelerator_type!r}; expected gcloud's names, e.g. "
            "v4-32, v5p-64, v5litepod-64 (v5e), v6e-64."
        )
    prefix, count = m.group(1), int(m.group(2))
    chip = next(c for c in CHIPS.values() if prefix in (c.gcloud_prefix, c.libtpu_name))
    if count % chip.cores_in_name or count // chip.cores_in_name not in chip.topologies:
        sizes = sorted(n * chip.cores_in_name for n in chip.topologies)
        raise ValueError(f"No {prefix} slice of size {count}; known sizes: {sizes}.")
    return Slice(accelerator_type, chip, count // chip.cores_in_name)


def topology_devices(s: Slice, num_slices: int = 1) -> list:
    """libtpu's compile-only devices of `num_slices` such slices (multislice), one per chip."""
    from jax.experimental import topologies

    # Compile-only use touches no chip: several compiles (tests, sweeps) may load libtpu at
    # once, which its single-user lockfile would otherwise refuse.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    bounds = (1, 1, 1) if s.chips < 4 else (2, 2, 1)
    desc = topologies.get_topology_desc(
        platform="tpu",
        topology_name=s.topology_name,
        chip_config_name=s.chip.chip_config,
        chips_per_host_bounds=bounds,
        num_slices=num_slices,
    )
    devices = list(desc.devices)
    if len(devices) != s.chips * num_slices:
        raise RuntimeError(
            f"libtpu gave {len(devices)} devices for {num_slices} x {s.topology_name}, not "
            f"{s.chips * num_slices}."
        )
    return devices
