"""The Triton kernels added without a GPU at hand build for the GPU they run on (sm_90) with
Triton's own compiler, here on the CPU: the interpreter that runs the kernel tests executes
Python, and lets through what the compiler refuses (types it cannot unify, a loop over a runtime
bound). Each with the argument types the runtime gives it. In a process of its own: these tests'
process imports the kernels for the interpreter (TRITON_INTERPRET=1), which the compiler cannot
build from."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

BUILD = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashpack.runtime.kernels.rms_norm import _rms_norm_kernel
from flashpack.runtime.kernels.tile_plan import PLAN_BLOCK, SEARCH_STEPS, _tile_starts_kernel, _tiles_kernel


def build(kernel, signature, constants):
    signature = {**signature, **{name: "constexpr" for name in constants}}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32))
    assert ".entry" in compiled.asm["ptx"]
    print("built", kernel.__name__, signature.get("keys_ptr") or signature.get("x_ptr"), flush=True)


sizes = {"pairs": "i32", "num_experts": "i32", "block_m": "i32"}
for keys in ("*i32", "*i64"):
    build(_tile_starts_kernel, {"keys_ptr": keys, "starts_ptr": "*i32", **sizes},
          {"STEPS": SEARCH_STEPS, "BLOCK": PLAN_BLOCK})
    build(_tiles_kernel, {"keys_ptr": keys, "begun_ptr": "*i64", "tiles_ptr": "*i32", "max_tiles": "i32", **sizes},
          {"STEPS": SEARCH_STEPS, "BLOCK": PLAN_BLOCK})
for dtype in ("*bf16", "*fp32"):
    for group, block in ((2560, 4096), (128, 128)):
        build(_rms_norm_kernel, {"x_ptr": dtype, "weight_ptr": dtype, "out_ptr": dtype, "eps": "fp32",
                                 "groups_a_row": "i32"}, {"GROUP": group, "BLOCK": block})
"""


def _run(script: str, folder=None) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    if folder is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(folder), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


def test_the_tile_plans_and_rms_norms_kernels_build_for_sm90():
    done = _run(BUILD)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("built") == 8


def test_control_a_kernel_the_interpreter_runs_and_the_compiler_refuses(tmp_path):
    """The build can fail: a loop-carried sum that starts as an integer and becomes a float runs in
    the interpreter (Python's numbers) and does not build (a loop's carried types must agree)."""
    (tmp_path / "drifting_sum.py").write_text(
        "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
        "def drifting_sum(x_ptr, out_ptr):\n    total = 0\n    for i in range(4):\n"
        "        total = total + tl.load(x_ptr + i).to(tl.float32)\n    tl.store(out_ptr, total)\n")
    interpreted = ("import os\nos.environ['TRITON_INTERPRET'] = '1'\nimport torch\nfrom drifting_sum import drifting_sum\n"
                   "out = torch.zeros(1)\ndrifting_sum[(1,)](torch.ones(4), out)\nassert out.item() == 4\n")
    assert _run(interpreted, tmp_path).returncode == 0
    built = (BUILD.split("\n\n\nsizes")[0] + "\nfrom drifting_sum import drifting_sum\n"
             "build(drifting_sum, {'x_ptr': '*fp32', 'out_ptr': '*fp32'}, {})\n")
    done = _run(built, tmp_path)
    assert done.returncode != 0 and "Loop-carried variable total" in done.stderr
