"""flashpack's own qwen4_exp engine: plain PyTorch modules, one concept per file.

    model = Qwen4ExpModel(source, fetcher, dtype=torch.bfloat16, device="cuda")
    state = model.new_state()                          # runtime.state.SequenceState
    out = model(prompt_ids, state, last_only=True)     # prefill: StepOutput(logits, streams)
    out = model(torch.tensor([token]), state)          # decode (or several tokens: verification)
    saved = state.snapshot(); state.restore(saved)     # deep copies: prompt reuse, rollback

    mtp = MTPHead(model, source, fetcher)              # draft the token after next:
    draft = mtp(out.streams[-1:], torch.tensor([token]), state)   # DraftOutput(logits, streams)

Files: norms, rope, linear (BF16 or FP8-row projections), hyper_connection, ple, deltanet, qsa_attention,
moe, decoder_layer, decode_graphs (CUDA-graph decode), model, mtp.
"""

from flashpack.runtime.model.model import Qwen4ExpModel, StepOutput
from flashpack.runtime.model.mtp import DraftOutput, MTPHead

__all__ = ["DraftOutput", "MTPHead", "Qwen4ExpModel", "StepOutput"]
