"""What the bench ran on: accelerator, CPUs, memory and library versions."""

from __future__ import annotations

import importlib.metadata
import os
import platform

import psutil
import torch


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(device: torch.device) -> dict:
    gpu = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = {"name": props.name, "memory_bytes": props.total_memory,
               "capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda}
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "device": str(device),
        "gpu": gpu,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "torch_threads": torch.get_num_threads(),
        "ram_bytes": psutil.virtual_memory().total,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in
                     ("flashpack", "torch", "triton", "transformers", "accelerate", "safetensors")},
    }
