"""The pieces a decode step's CUDA graphs are made of, as module-level functions taking the layer
and its state as arguments, so that every layer of a kind shares one compiled graph
(decode_graphs.py). Slot-table codes are runtime/experts.py's: a device slot (>= 0), a host-cache
slot (<= -2), or on disk (-1)."""

from __future__ import annotations

import torch

from flashpack.runtime.experts import LATE_ROWS, ON_DISK, HostRecords, host_code, host_slot_of
from flashpack.runtime.kernels import stage_records
from flashpack.runtime.model.decoder_layer import DecoderLayer, mixer_input, moe_input, moe_output


def layer_front(layer: DecoderLayer, streams, position, ple_rows, ple_state, mixer_state):
    """[PLE addend,] attention-side mix, the sequence mixer, combine: streams before the MoE block."""
    if ple_rows is not None:
        streams = streams + layer.ple.addend(streams, ple_rows, ple_state)
    block_input, inject = layer.attn_hc.mix(streams)
    if layer.linear:
        mixed = layer.mixer(block_input, mixer_state)
    else:
        attention = layer.mixer
        q, gate, k, v, index_q, index_k = attention.project(block_input, position)
        mixed = attention.output(attention.attend_step(q, k, v, index_q, index_k, mixer_state, position), gate)
    return layer.attn_hc.combine(streams, mixed, inject)


def attention_mix(layer: DecoderLayer, streams):
    """The attention-side hyper-connection mix: (block input, inject). This and `mixed_route` and
    `expert_combine` call the model's pieces (decoder_layer.py) from code objects of their own:
    dynamo keeps its compiled variants per code object, up to a limit, and a checked step's lengths
    are variants a prompt's compiled pieces never meet."""
    return mixer_input(layer, streams)


def checked_mixer(layer: DecoderLayer, block_input, position, mixer_state):
    """The sequence mixer over the T rows of a checked step at position .. position + T - 1
    (position int64 [1] on the device). DeltaNet's state is tracked, so it runs its tokens one by
    one; attention writes and attends token after token, so each sees the ones before it and none
    after."""
    if layer.linear:
        return layer.mixer(block_input, mixer_state)
    attention, count = layer.mixer, block_input.shape[0]
    positions = position + torch.arange(count, device=position.device)
    q, gate, k, v, index_q, index_k = attention.project(block_input, positions)
    attended = torch.cat([
        attention.attend_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], index_q[t:t + 1], index_k[t:t + 1],
                              mixer_state, positions[t:t + 1])
        for t in range(count)])
    return attention.output(attended, gate)


def mixed_route(layer: DecoderLayer, streams, mixed, inject):
    """The mixer's output combined, the MoE-side mix, router and shared expert: (streams, MoE input,
    its inject, routing weights, expert ids, shared expert output)."""
    return moe_input(layer, streams, mixed, inject)


def _host_offsets(codes: torch.Tensor, wanted: torch.Tensor, host: HostRecords) -> torch.Tensor:
    """int64 [k]: the word offset of each wanted host-cache code's record, -1 elsewhere."""
    host_slots = torch.where(wanted, host_slot_of(codes), 0).flatten()
    return torch.where(wanted.flatten(), host.offsets[host_slots], -1)


def table_slots(experts, weights, code_row, host: HostRecords | None,
                ahead: tuple[torch.Tensor, torch.Tensor] | None):
    """Where a layer's experts [1, k] are, from its slot-table row `code_row` [num_experts] (the
    codes of runtime/experts.py). Experts in the host cache come from the rows they were staged
    into ahead, as the previous layer predicted them (`ahead`: predicted ids [1, k] and their bank
    rows, -1 where not staged), or are staged into the LATE_ROWS staging rows now. Returns (bank
    rows, routing `weights` with the experts on disk weighted zero, codes, on disk, staged ahead),
    each [1, k]; a disk expert's row is 0."""
    codes = code_row[experts]
    if host is None:  # no staging rows: host experts miss as disk ones do
        missing = codes < 0
        return codes.clamp(min=0), weights.masked_fill(missing, 0), codes, missing, torch.zeros_like(missing)
    in_host = codes <= host_code(0)
    early, early_row = torch.zeros_like(in_host), torch.zeros_like(codes)
    if ahead is not None:
        ahead_ids, ahead_rows = ahead
        match = (experts.unsqueeze(-1) == ahead_ids.unsqueeze(-2)) & (ahead_rows >= 0).unsqueeze(-2)  # [1, k, k]
        early = in_host & match.any(-1)
        early_row = (match * ahead_rows.unsqueeze(-2)).sum(-1).to(codes.dtype)  # predicted ids are distinct
    late = in_host & ~early
    stage_records(host.source, _host_offsets(codes, late, host), host.rows(LATE_ROWS))
    late_rows = host.first_slot(LATE_ROWS) + torch.arange(codes.shape[-1], device=codes.device, dtype=codes.dtype)
    slots = torch.where(early, early_row, torch.where(late, late_rows, codes))
    missing = codes == ON_DISK
    return slots.clamp(min=0), weights.masked_fill(missing, 0), codes, missing, early


def ahead_offsets(predicted, code_row, host: HostRecords, row_set: int, first: int):
    """The next layer's predicted experts [1, k] that are in the host cache, against its slot-table
    row: offsets [k] for staging the first `first` of them now and the rest later, into staging row
    set `row_set` (-1 where the other stages, or where not in the host cache), and their bank rows
    [1, k] (-1 where not staged)."""
    codes = code_row[predicted]
    in_host = codes <= host_code(0)
    rows = host.first_slot(row_set) + torch.arange(codes.shape[-1], device=codes.device, dtype=codes.dtype)
    offsets, found = _host_offsets(codes, in_host, host), in_host.flatten()
    now = found & (torch.cumsum(found, 0) <= first)
    return torch.where(now, offsets, -1), torch.where(now, -1, offsets), torch.where(in_host, rows, -1)


def tiered_route(layer: DecoderLayer, next_moe, streams):
    """Up to the routed experts: (MoE input, its inject, routing weights, expert ids, shared expert
    output, the ids `next_moe` (the next layer's block, or None: no prediction) picks from this
    layer's input, or None)."""
    x, inject = layer.mlp_hc.mix(streams)
    weights, experts, shared = layer.moe.gate(x)
    return x, inject, weights, experts, shared, None if next_moe is None else next_moe.route(x)[1]


def expert_combine(layer: DecoderLayer, streams, routed, shared, inject):
    """The routed and the shared experts' outputs into the streams (one fused kernel compiled)."""
    return moe_output(layer, streams, routed, shared, inject)
