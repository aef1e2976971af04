"""A vLLM general plugin: vLLM loads it in each of its processes, the engine core's
included, before the model runs (entry point group ``vllm.general_plugins``).

On an x86 CPU with AMX, Linux hands a process the AMX tile state only once the process
asks for it (``arch_prctl(ARCH_REQ_XCOMP_PERM)``), and the permission does not survive
``exec``. vLLM's CPU attention kernel uses AMX for bfloat16 without asking, so in an
engine core that has not happened to run a oneDNN AMX kernel first, the first forward
pass dies of an illegal instruction (seen through the sidecar on a Sapphire Rapids
host; the unit then reports the engine dead). Asking costs one system call.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def request_amx_tiles() -> None:
    """Ask for AMX tile state where the CPU has AMX; elsewhere do nothing."""
    try:
        import torch  # type: ignore[import-not-found,unused-ignore]
    except ImportError:  # not in vLLM's environment
        return
    cpu = getattr(torch, "cpu", None)
    if cpu is None or not hasattr(cpu, "_is_amx_tile_supported"):
        return  # a torch without these (older, or not built for x86)
    if cpu._is_amx_tile_supported() and not cpu._init_amx():
        log.warning("this CPU has AMX but the kernel refused this process its tile state")
