"""flashpack's own qwen4_exp engine: plain PyTorch modules, one concept per file.

    model = Qwen4ExpModel(source, experts, dtype=torch.bfloat16, device="cuda")   # experts: RoutedExperts
    state = model.new_state()                          # runtime.state.SequenceState
    out = model(prompt_ids, state, last_only=True)     # prefill: StepOutput(logits, streams)
    out = model(torch.tensor([token]), state)          # decode (or several tokens: verification)
    saved = state.snapshot(); state.restore(saved)     # deep copies: prompt reuse, rollback

    mtp = MTPHead(model, source)                       # draft the token after next:
    draft = mtp(out.streams[-1:], torch.tensor([token]), state)   # DraftOutput(logits, streams)

Files: norms, rope, linear (BF16 or FP8-row projections), hyper_connection, ple, deltanet, qsa_attention,
moe, routed_experts (the interface the MoE block gets its experts through, and its plain form),
decoder_layer, model, mtp, host_copy (pinned staging for host-built tensors), compiled (the plain code
between the layers' own kernels, compiled by torch.compile where the model is told to). How a step runs
(CUDA graphs, the expert store, generation) is the engine's: runtime/engine/.
"""

from flashpack.runtime.model.model import Qwen4ExpModel, StepOutput
from flashpack.runtime.model.mtp import DraftOutput, MTPHead

__all__ = ["DraftOutput", "MTPHead", "Qwen4ExpModel", "StepOutput"]
