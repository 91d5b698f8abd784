"""The calls the engine makes: `moe_experts`, `moe_expert_pairs`, `dense_linear`, `fp8_linear`,
`stage_records`, `router_top_k`, `decode_attention` and `prompt_attention`, Triton where it runs,
else reference.

backend="auto" takes the Triton kernels on CUDA and the plain-PyTorch reference anywhere else;
"triton" and "reference" force one side. The tests force "triton" on a CPU, where the kernels run
in Triton's interpreter (TRITON_INTERPRET=1 set before this package's kernels were first imported):
correct but far too slow for an engine, which is why "auto" never picks it. Under the interpreter
the tile kernels run precision="fp32" (its bf16 tl.dot is wrong); on CUDA they run bf16 tensor cores
for a BF16/FP16 engine and IEEE float32 dots for an FP32 one, which must match an FP32 reference
(`flashpack verify --dtype float32` gates every layer at 1e-5).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from flashpack.runtime.kernels.bank import ExpertBank
from flashpack.runtime.kernels.reference import (
    decode_attention_reference, expert_pairs_reference, expert_swiglu_reference, fp8_linear_reference,
    prompt_attention_reference, router_top_k_reference, stage_records_reference,
)

BACKENDS = ("auto", "triton", "reference")
# FP8 projections of up to this many tokens take matvec.py's kernel, more the tile kernel on tensor
# cores: the default of fp8_linear's `matvec_max_tokens` (the engine's
# EngineConfig.fp8_matvec_max_tokens). One token always; two or three only for matrices of fewer than
# FP8_SEVERAL_TOKENS_MAX_ROWS rows. The matvec's time grows with the tokens, the few-token tiles'
# does not (bench/kernels.py --only fp8-few on an H200, us at 1 / 3 / 5 tokens): DeltaNet's stacked
# input projection 12288 x 2560 matvec 13.2 / 30.4 / 52.6 against tiles 15.6 / 15.3 / 15.3, the
# attention's query 6144 x 2560 7.8 / 16.3 / 28.0 against 11.6 / 11.4 / 11.4, but DeltaNet's output
# projection 2560 x 4096 5.7 / 10.5 / 17.9 against 13.1 / 12.1 / 12.1.
FP8_MATVEC_MAX_TOKENS = 3
FP8_SEVERAL_TOKENS_MAX_ROWS = 4096
# BF16 projections of up to this many tokens take matvec.py's kernel, more cuBLAS: the default of
# dense_linear's `matvec_max_tokens` (the engine's EngineConfig.dense_matvec_max_tokens; 0 puts every
# projection on cuBLAS). One token always; two or three (a checked step of one or two drafts) only
# for matrices of fewer than SEVERAL_TOKENS_MAX_ROWS rows, where cuBLAS's kernels for a few rows run
# far below the memory's rate while the matvec's do not (bench/kernels.py --only dense on an H200, at
# 3 tokens: the router and shared expert's stack 1793 x 2560 6.7 against 29.0 us, a hyper-connection's
# down projection 324 x 10240 5.5 against 10.7); on taller ones cuBLAS wins from two or three tokens
# on (DeltaNet's input projection 12352 x 2560: 30.0 against 19.3 us at 3 tokens), and at 5 tokens
# (a program of 8) the matvec loses on all but the router's stack.
DENSE_MATVEC_MAX_TOKENS = 3
SEVERAL_TOKENS_MAX_ROWS = 2048
# BF16 projections of more tokens than the matvec takes, up to this many, take the tile kernel's
# few-token tiles (tile_linear.py) where the matrix has fewer than SEVERAL_TOKENS_MAX_ROWS rows: the
# default of dense_linear's `tile_max_tokens` (the engine's EngineConfig.dense_tile_max_tokens; 0
# leaves them to cuBLAS). On such short matrices cuBLAS's few-row kernels stay far below the memory's
# rate, and the tiles with their columns split do not (bench/kernels.py --only dense-few on an H100,
# us at 5 / 8 / 16 tokens): a hyper-connection's down projection 324 x 10240 7.6 / 7.6 / 7.7 against
# 11.0 / 11.1 / 11.2, the router's stack 513 x 2560 6.4 / 6.6 / 7.0 against 11.9 / 12.5 / 12.4,
# DeltaNet's b and a 64 x 2560 3.9 against 5.5; on taller ones cuBLAS is as fast or faster (the
# hyper-connection's up projection 10240 x 320 5.0 against 5.8, the indexer's 2176 x 2560 7.5
# against 9.1 at 5 tokens).
DENSE_TILE_MAX_TOKENS = 16
TILE_DTYPES = (torch.bfloat16, torch.float32)  # float32: an FP32 engine's, in IEEE dots; FP16 is not rounded to bf16
DECODE_MAX_TOKENS = 16  # up to here the matvec kernels beat the grouped ones on an H200 (bench/kernels.py)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernels_interpreted() -> bool:
    """Whether this process built the Triton kernels for the CPU interpreter."""
    from flashpack.runtime.kernels import expert_decode

    return type(expert_decode._gate_up_kernel).__name__ == "InterpretedFunction"


def use_triton(device: torch.device | str, backend: str = "auto") -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend == "triton"
    return torch.device(device).type == "cuda" and triton_available()


def tile_precision(device: torch.device, dtype: torch.dtype) -> str:
    """The tile kernels' dot precision for activations of `dtype` on `device`: bf16 tensor cores on
    CUDA unless the engine computes in float32, where rounding x and h to bf16 (2^-9) would put a
    prompt's experts far outside the 1e-5 an FP32 engine is held to."""
    return "bf16" if device.type == "cuda" and dtype != torch.float32 else "fp32"


@torch.compiler.disable  # the Triton kernels are launched as they are from compiled decode steps
def moe_experts(
    x: torch.Tensor, bank: ExpertBank, slots: torch.Tensor, weights: torch.Tensor,
    out: torch.Tensor | None = None, backend: str = "auto", decode_max_tokens: int = DECODE_MAX_TOKENS,
) -> torch.Tensor:
    """Routed SwiGLU experts. x [T, H]; slots [T, K] int (rows of `bank`); weights [T, K].
    Returns [T, H] in x.dtype (or written into `out`):
        out[t] = sum_k weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]),  e = slots[t, k].
    Up to `decode_max_tokens` tokens use the matvec kernels (float32 throughout), more the grouped
    W4A16 kernels (bf16 operands on CUDA)."""
    if not use_triton(x.device, backend):
        result = expert_swiglu_reference(x, bank, slots, weights)
        return result if out is None else out.copy_(result)
    if x.shape[0] <= decode_max_tokens:
        from flashpack.runtime.kernels.expert_decode import nvfp4_expert_swiglu

        return nvfp4_expert_swiglu(x, bank, slots, weights, out=out)
    from flashpack.runtime.kernels.expert_grouped import nvfp4_expert_swiglu_grouped

    return nvfp4_expert_swiglu_grouped(x, bank, slots, weights, out=out, precision=tile_precision(x.device, x.dtype),
                                       block_m=_grouped_block_m(slots, bank))


def _grouped_block_m(slots: torch.Tensor, bank: ExpertBank) -> int:
    """Tiles of 16 rows when experts get few tokens each (batched decode), 64 for prompts."""
    return 16 if slots.numel() < 16 * bank.num_experts else 64


@torch.compiler.disable
def moe_expert_pairs(
    x: torch.Tensor, bank: ExpertBank, slots: torch.Tensor, weights: torch.Tensor, y: torch.Tensor,
    bound: tuple[int, int] | None = None, backend: str = "auto",
) -> torch.Tensor:
    """A prompt's routed experts, some of them: y float32 [T * K, H] gets row t * K + k =
    weights[t, k] * expert_e(x[t]) for each pair whose slot e = slots[t, k] is not -1; the others
    are left. Summing y over k, once every chunk of experts has run, gives `moe_experts`. `bound`
    (pairs computed, distinct slots among them), where known, sizes the grouped kernels' grid.
    Always the grouped kernels: what is computed, not how the store chunked it, picks the kernel."""
    if not use_triton(x.device, backend):
        return expert_pairs_reference(x, bank, slots, weights, y)
    from flashpack.runtime.kernels.expert_grouped import nvfp4_expert_pairs_grouped

    return nvfp4_expert_pairs_grouped(x, bank, slots, weights, y, bound=bound, block_m=_grouped_block_m(slots, bank),
                                      precision=tile_precision(x.device, x.dtype))


def dense_linear(x: torch.Tensor, weight: torch.Tensor, backend: str = "auto",
                 matvec_max_tokens: int = DENSE_MATVEC_MAX_TOKENS,
                 tile_max_tokens: int = DENSE_TILE_MAX_TOKENS) -> torch.Tensor:
    """x [..., C] @ weight [R, C]^T -> [..., R]: F.linear, or on CUDA the matvec kernel for one token
    and for up to `matvec_max_tokens` tokens of a matrix of fewer than SEVERAL_TOKENS_MAX_ROWS rows,
    and the tile kernel's few-token tiles for up to `tile_max_tokens` tokens of such a matrix: where
    each reads the matrix nearer the memory's bandwidth than cuBLAS does."""
    if not use_triton(x.device, backend):
        return F.linear(x, weight)
    tokens = x.numel() // x.shape[-1]
    short = weight.shape[0] < SEVERAL_TOKENS_MAX_ROWS
    if tokens <= matvec_max_tokens and (tokens == 1 or short):
        return _dense_matvec(x, weight)
    if tokens <= tile_max_tokens and short and weight.dtype in TILE_DTYPES:
        return _dense_tiles(x, weight)
    return F.linear(x, weight)


@torch.compiler.disable  # launched as it is from compiled decode steps, like the kernels below
def _dense_matvec(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from flashpack.runtime.kernels.matvec import matvec

    return matvec(x, weight)


@torch.compiler.disable
def _dense_tiles(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from flashpack.runtime.kernels.tile_linear import tile_linear

    return tile_linear(x, weight, precision="fp32" if weight.dtype == torch.float32 else "bf16")


@torch.compiler.disable
def fp8_linear(
    x: torch.Tensor, values: torch.Tensor, row_scale: torch.Tensor,
    out: torch.Tensor | None = None, backend: str = "auto", matvec_max_tokens: int = FP8_MATVEC_MAX_TOKENS,
) -> torch.Tensor:
    """x [..., C], values float8_e4m3fn [R, C], row_scale float32 [R] -> [..., R] in x.dtype:
    x @ (values * row_scale[:, None])^T; on CUDA one token and up to `matvec_max_tokens` tokens of a
    matrix of fewer than FP8_SEVERAL_TOKENS_MAX_ROWS rows on the matvec kernel, more on the tile kernel."""
    if not use_triton(x.device, backend):
        result = fp8_linear_reference(x, values, row_scale)
        return result if out is None else out.copy_(result)
    from flashpack.runtime.kernels.fp8_linear import fp8_linear_triton

    if values.shape[0] >= FP8_SEVERAL_TOKENS_MAX_ROWS:
        matvec_max_tokens = min(matvec_max_tokens, 1)
    return fp8_linear_triton(x, values, row_scale, out=out, precision=tile_precision(x.device, x.dtype),
                             matvec_max_tokens=matvec_max_tokens)


@torch.compiler.disable
def stage_records(
    source: torch.Tensor, offsets: torch.Tensor, target: torch.Tensor, backend: str = "auto", programs: int = 0,
) -> torch.Tensor:
    """Copy records into device rows: source int32 [N] (on CUDA, pinned host memory the kernel
    reads in place), offsets int64 [K] in int32 words (-1: leave the row), target int32 [K, words].
    `programs` > 0 bounds the kernel's footprint on the GPU (for staging beside other work)."""
    if not use_triton(target.device, backend):
        return stage_records_reference(source, offsets, target)
    from flashpack.runtime.kernels.stage_records import stage_records_triton

    return stage_records_triton(source, offsets, target, programs=programs)


@torch.compiler.disable
def router_top_k(
    logits: torch.Tensor, k: int, renormalise: bool, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights float32 [T, k], expert ids int64 [T, k]): the top k of the softmax
    over the experts, descending, renormalised to sum 1 when `renormalise`."""
    if not use_triton(logits.device, backend):
        return router_top_k_reference(logits, k, renormalise)
    from flashpack.runtime.kernels.router_top_k import router_top_k_triton

    return router_top_k_triton(logits, k, renormalise)


@torch.compiler.disable
def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """One token's attention over a KV cache buffer, masked: q [kv_heads, group, hd], keys/values
    [kv_heads, capacity, hd], keep bool [capacity] -> [kv_heads, group, hd] in q's dtype."""
    if not use_triton(q.device, backend):
        return decode_attention_reference(q, keys, values, keep, scale, dtype=None)
    from flashpack.runtime.kernels.decode_attention import decode_attention as decode_attention_triton

    return decode_attention_triton(q, keys, values, keep, scale)


def prompt_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: torch.Tensor, first: int, ratio: int,
    scale: float, backend: str = "auto",
) -> torch.Tensor:
    """A prompt's QSA attention over the key blocks each query picked: q [T, heads, hd] at positions
    first.., keys/values [kv_heads, L, hd], blocks int [T, NB] (-1 pads) -> [T, heads, hd] in q's dtype."""
    if not use_triton(q.device, backend):
        return prompt_attention_reference(q, keys, values, blocks, first, ratio, scale, dtype=None)
    from flashpack.runtime.kernels.prompt_attention import prompt_attention as prompt_attention_triton

    return prompt_attention_triton(q, keys, values, blocks, first, ratio, scale)
