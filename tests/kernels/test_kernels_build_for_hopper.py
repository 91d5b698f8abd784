"""A prompt step's Triton kernels build for the GPU they run on (sm_90) with Triton's own
compiler, here on the CPU: the interpreter that runs the kernel tests executes Python, and lets
through what the compiler refuses (types it cannot unify, loop-carried values that change type).
Each with the argument types and constants the runtime gives it at real dimensions (H 2560, I 640,
top-10; 128-wide heads in groups of 8, blocks of 4 keys): the tile plan, the grouped experts, the
tile kernel (BF16 and FP8 weights), the prompt's attention and the RMS norm. In a process of its
own: these tests' process imports the kernels for the interpreter (TRITON_INTERPRET=1), which the
compiler cannot build from."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

PRELUDE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import triton.language as tl

from flashpack.runtime.kernels.expert_grouped import _grouped_down_kernel, _grouped_gate_up_kernel
from flashpack.runtime.kernels.prompt_attention import _prompt_attention_kernel
from flashpack.runtime.kernels.rms_norm import _rms_norm_kernel
from flashpack.runtime.kernels.tile_linear import _tile_kernel
from flashpack.runtime.kernels.tile_plan import PLAN_BLOCK, SEARCH_STEPS, _tile_starts_kernel, _tiles_kernel


def build(kernel, signature, constants):
    signature = {**signature, **{name: "constexpr" for name in constants}}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32))
    assert ".entry" in compiled.asm["ptx"]
    print("built", kernel.__name__, flush=True)
"""
BUILD = PRELUDE + """
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
blocks = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "DOT": tl.bfloat16}
records = {"gate_nib_ptr": "*u8", "up_nib_ptr": "*u8", "gate_scale_ptr": "*u8", "up_scale_ptr": "*u8",
           "global_ptr": "*fp32", "gate_nib_stride": "i32", "up_nib_stride": "i32", "gate_scale_stride": "i32",
           "up_scale_stride": "i32", "global_stride": "i32"}
build(_grouped_gate_up_kernel, {"x_ptr": "*bf16", "order_ptr": "*i32", "tiles_ptr": "*i32", "h_ptr": "*bf16",
                                "max_tiles": "i32", **records}, {"H": 2560, "I": 640, "K": 10, **blocks})
build(_grouped_down_kernel, {"h_ptr": "*bf16", "order_ptr": "*i32", "tiles_ptr": "*i32", "weights_ptr": "*fp32",
                             "y_ptr": "*fp32", "max_tiles": "i32", "down_nib_ptr": "*u8", "down_scale_ptr": "*u8",
                             "global_ptr": "*fp32", "down_nib_stride": "i32", "down_scale_stride": "i32",
                             "global_stride": "i32"}, {"H": 2560, "I": 640, **blocks})
for weight, fp8 in (("*bf16", False), ("*u8", True)):
    build(_tile_kernel, {"x_ptr": "*bf16", "w_ptr": weight, "scale_ptr": "*fp32" if fp8 else weight, "y_ptr": "*bf16",
                         "partial_ptr": "*fp32", "counter_ptr": "*i32", "T": "i32", "R": "i32"},
          {"C": 2560, "SPLIT_C": 2560, "SPLITS": 1, "FP8": fp8, "SCALED": fp8, "BLOCK_M": 128, "BLOCK_N": 128,
           "BLOCK_K": 64, "DOT": tl.bfloat16})
strides = {name: "i32" for name in ("stride_qt", "stride_qh", "stride_kh", "stride_kn", "stride_vh", "stride_vn",
                                     "stride_bt", "stride_ot", "stride_oh")}
build(_prompt_attention_kernel, {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "blocks_ptr": "*i32",
                                 "out_ptr": "*bf16", "first": "i32", "qk_scale": "fp32", **strides},
      {"GROUP": 8, "HD": 128, "GROUP_PAD": 16, "HD_PAD": 128, "RATIO": 4, "BLOCK_N": 64, "STEPS": 8,
       "DOT": tl.bfloat16})
"""


def _run(script: str, folder=None) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    if folder is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(folder), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


def test_a_prompt_steps_kernels_build_for_sm90():
    done = _run(BUILD)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("built") == 13


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
    built = PRELUDE + "from drifting_sum import drifting_sum\nbuild(drifting_sum, {'x_ptr': '*fp32', 'out_ptr': '*fp32'}, {})\n"
    done = _run(built, tmp_path)
    assert done.returncode != 0 and "Loop-carried variable total" in done.stderr
