"""Which JAX platforms a command starts: no TPU discovery on a machine without TPUs.

With libtpu installed (the compile tool's extra), JAX tries the TPU backend at its first device
query on any machine, and on one without TPUs libtpu prints its failed discovery (`Failed to
find host bounds for accelerator type`, `unexpected worker hostname`, a source location trace)
before JAX falls back to the CPU. `quiet_start` restricts JAX's platforms, when nobody chose
them and the machine has no TPU, to those it can use; a TPU VM and an explicit `JAX_PLATFORMS`
are left as they are. It is a global switch: commands call it first thing in their `main`,
never at import. The compile tool's compile-only topologies (`jax.experimental.topologies`)
load libtpu on their own and do not depend on it.
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import pkgutil
from collections.abc import Callable, Mapping

# A TPU VM's chips: /dev/accel* (v2-v5p), /dev/vfio/* (v5e, v6e).
TPU_DEVICES = ("/dev/accel*", "/dev/vfio/*")
# A TPU on the PCI bus: Google's vendor id and the TPU device ids (those JAX's own check,
# `jax._src.hardware_utils`, knows: v3, v4, v5p, v5e, v6e, 7x).
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076")
# Set where a TPU is meant to be used (GKE, by hand for libtpu, or to force JAX's TPU start);
# not TPU_SKIP_MDS_QUERY or TPU_LIBRARY_PATH, which importing JAX sets wherever libtpu is.
TPU_ENV = (
    "TPU_ACCELERATOR_TYPE",
    "TPU_WORKER_HOSTNAMES",
    "TPU_WORKER_ID",
    "TPU_NAME",
    "TPU_CHIPS_PER_HOST_BOUNDS",
    "TPU_HOST_BOUNDS",
    "JAX_FORCE_TPU_INIT",
)
# Accelerator plugins JAX may load, and the device files that say their hardware is present.
GPU_PLUGINS = {"cuda": ("/dev/nvidiactl", "/dev/nvidia0"), "rocm": ("/dev/kfd",)}


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def tpu_on_pci(exists: Callable[[str], list[str]] = glob.glob, read=_read) -> bool:
    """Whether a TPU chip is on the PCI bus (the test JAX makes before starting libtpu)."""
    for vendor in exists("/sys/bus/pci/devices/*/vendor"):
        if read(vendor) == GOOGLE_PCI_VENDOR:
            if read(os.path.join(os.path.dirname(vendor), "device")) in TPU_PCI_DEVICES:
                return True
    return False


def has_tpu(
    environ: Mapping[str, str], exists: Callable[[str], list[str]] = glob.glob, read=_read
) -> bool:
    """Whether this machine may have TPUs: their device files, a TPU on the PCI bus, or the
    variables of a machine meant to use one."""
    return (
        any(exists(p) for p in TPU_DEVICES)
        or any(environ.get(v) for v in TPU_ENV)
        or tpu_on_pci(exists, read)
    )


def installed_plugins() -> set[str]:
    """The names of the PJRT plugins JAX would discover (namespace packages, entry points)."""
    names = set()
    try:
        import jax_plugins

        names |= {m.name for m in pkgutil.iter_modules(jax_plugins.__path__)}
    except ImportError:
        pass
    names |= {e.name for e in importlib.metadata.entry_points(group="jax_plugins")}
    return names


def cpu_start_platforms(
    environ: Mapping[str, str],
    plugins: set[str],
    exists: Callable[[str], list[str]] = glob.glob,
    read: Callable[[str], str] = _read,
) -> str | None:
    """The `jax_platforms` value that skips TPU discovery here, or None to leave JAX's default.

    Args:
      environ: the process environment.
      plugins: installed PJRT plugin names (`installed_plugins`).
      exists, read: a glob and a file reader; tests pass a fake machine's.

    Returns:
      None when `JAX_PLATFORMS` is set, the machine may have TPUs, or a plugin other than a GPU
      one is installed (JAX's own choice stands); else "cpu", after the GPU platforms whose
      plugin is installed and whose devices are present (e.g. "cuda,cpu").
    """
    if "JAX_PLATFORMS" in environ or has_tpu(environ, exists, read):
        return None
    chosen = []
    for plugin in sorted(plugins):
        kind = next((k for k in GPU_PLUGINS if k in plugin), None)
        if kind is None:
            return None  # An accelerator we do not know: leave JAX's discovery to it.
        if any(exists(d) for d in GPU_PLUGINS[kind]) and kind not in chosen:
            chosen.append(kind)
    return ",".join([*chosen, "cpu"])


def quiet_start() -> str | None:
    """Restricts JAX's platforms on a machine without TPUs (see the module); call it in `main`
    before anything touches a device. Returns the platforms set, or None where it left them."""
    import jax

    platforms = cpu_start_platforms(os.environ, installed_plugins())
    if platforms is not None and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", platforms)
        return platforms
    return None
