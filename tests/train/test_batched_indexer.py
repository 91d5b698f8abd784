"""The training QSA indexer selects exactly the tokens transformers' per-query loop selects.

Block scores are sums of relu over indexer heads, so with few heads whole rows of blocks score 0
and top-k may break those ties either way; the models here get 8 heads, where a tie at the cut
needs every head negative on several blocks at once (none at these seeds).
"""

from __future__ import annotations

import copy

import torch
from reference_model import perturb
from transformers import Qwen4ExpForCausalLM

from flashpack.convert.train.batched_indexer import BatchedQSAIndexer, install_batched_indexers
from flashpack.convert.train.model_config import transformers_config

LENGTH = 45  # 11 complete blocks of 4 and a tail: past the smoke model's budget of 16 tokens (4 blocks)


def _models():
    torch.manual_seed(0)
    config = transformers_config("smoke")
    config.indexer_n_heads = 8
    reference = Qwen4ExpForCausalLM(config).eval()
    perturb(reference, seed=3)
    batched = copy.deepcopy(reference)
    assert install_batched_indexers(batched) == 2
    return reference, batched


def _masks(model, tokens):
    masks = []
    hooks = [
        module.register_forward_hook(lambda _m, _args, out: masks.append(out))
        for module in model.modules()
        if module.__class__.__name__.endswith("QSAIndexer")
    ]
    with torch.no_grad():
        logits = model(tokens, use_cache=False).logits
    for hook in hooks:
        hook.remove()
    return masks, logits


def test_batched_selection_and_logits_match_transformers_loop():
    reference, batched = _models()
    tokens = torch.randint(0, 992, (3, LENGTH), generator=torch.Generator().manual_seed(1))
    expected_masks, expected_logits = _masks(reference, tokens)
    masks, logits = _masks(batched, tokens)
    for expected, got in zip(expected_masks, masks, strict=True):
        assert got.shape == expected.shape == (3, 1, LENGTH, LENGTH)
        assert torch.equal(got, expected)
        # The budget binds: late queries keep 4 blocks of 4 plus their tail, not everything.
        assert got[:, 0, -1].sum(-1).max() < LENGTH
    assert torch.allclose(logits, expected_logits, rtol=1e-5, atol=1e-5)


def test_kept_scores_train_only_the_indexer():
    _, batched = _models()
    indexer = next(m for m in batched.modules() if isinstance(m, BatchedQSAIndexer))
    batched(torch.randint(0, 992, (2, LENGTH)), use_cache=False)
    assert indexer.last_scores.shape == indexer.last_selected.shape == (2, LENGTH, LENGTH // 4)
    indexer.last_scores.sum().backward()
    assert indexer.index_qk_proj.weight.grad is not None
    assert batched.model.embed_tokens.weight.grad is None  # the indexer's input was detached


def test_control_other_indexer_weights_select_other_tokens():
    reference, batched = _models()
    with torch.no_grad():
        for module in batched.modules():
            if isinstance(module, BatchedQSAIndexer):
                module.index_qk_proj.weight.copy_(torch.randn_like(module.index_qk_proj.weight))
    tokens = torch.randint(0, 992, (3, LENGTH), generator=torch.Generator().manual_seed(1))
    expected_masks, _ = _masks(reference, tokens)
    masks, _ = _masks(batched, tokens)
    assert not all(torch.equal(a, b) for a, b in zip(expected_masks, masks))
