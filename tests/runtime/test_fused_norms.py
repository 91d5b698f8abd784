"""`fused_norms`: the RMS norms of steps run eagerly as runtime/kernels/rms_norm.py's kernel. On the
GPU an engine with them prefills and decodes what the module's code does (float32: the sum of
squares in another order); on a CPU the engine runs the module's code whatever the setting, and the
model refuses them when asked directly."""

from __future__ import annotations

import pytest
import torch

from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.model.norms import RMSNorm
from tests.runtime.test_decode_graphs import _decode, _gpu_engine, _worst, needs_gpu


def _norms(engine) -> list[RMSNorm]:
    return [module for module in engine.model.modules() if isinstance(module, RMSNorm)]


@needs_gpu
@pytest.mark.parametrize("tiered", [None, 60], ids=["resident", "tiered-60"])
def test_fused_norms_match_the_modules_code(tiny_pack, tiered):
    prompt = torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(5))
    plain = _gpu_engine(tiny_pack, tiered, cuda_graphs=False)
    fused = _gpu_engine(tiny_pack, tiered, cuda_graphs=False, fused_norms=True)
    assert not any(norm.use_kernel for norm in _norms(plain)) and all(norm.use_kernel for norm in _norms(fused))
    expected, got = _decode(plain, prompt, 12), _decode(fused, prompt, 12)
    assert _worst(got, expected) < 1e-4


def test_fused_norms_need_cuda(tiny_pack):
    from flashpack.layout.pack import Pack
    from flashpack.runtime.model import Qwen4ExpModel
    from flashpack.runtime.pack_source import PackExperts, PackWeights

    engine = load_engine(tiny_pack, EngineConfig(fused_norms=True))
    assert _norms(engine) and not any(norm.use_kernel for norm in _norms(engine))
    pack = Pack.open(tiny_pack)
    with pytest.raises(ValueError, match="CUDA only"):
        Qwen4ExpModel(PackWeights(pack), PackExperts(pack), dtype=torch.float32, fused_norms=True)
