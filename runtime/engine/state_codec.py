"""A SequenceState as bytes and back: what a stored prompt state holds (stored_states.py).

The bytes are safetensors' format (no pickle: a file from elsewhere cannot run code), the tensors
named by part and layer (`deltanet.3.conv`, `attention.7.keys`, `ple.0.context`, ...), with the
position and each attention cache's length and blocks in its metadata, and the MTP head's pending
input where the state has one. Only filled parts are written (a snapshot is compact already).

Encoding lays the format out here rather than calling safetensors' `save`, which builds the whole
file as one bytes object while holding the GIL: hundreds of milliseconds for a 32k-token state on
the stored states' writer thread, through which the request thread that saved the checkpoint could
not run a line (its time to first token grew by that much). `encode_state` returns the header and
views of the tensors' own bytes, copying nothing; safetensors reads the result (tested). Decoding checks every tensor against a fresh state of the same model: a
missing or extra part, a shape or dtype that differs, is a StateFormatError, never a state that
would compute something else.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from flashpack.runtime.state import AttentionCache, DeltaNetState, PLEState, SequenceState


class StateFormatError(ValueError):
    """Bytes that are not a state of this model."""


def encode_state(state: SequenceState) -> list[memoryview]:
    """The state's safetensors bytes in pieces: the header, then each tensor's bytes (views of the
    state's host tensors where they are contiguous, which a live entry's are)."""
    tensors: dict[str, torch.Tensor] = {}
    lengths = {}
    for layer in state.layers():  # layer by layer: a reader can restore each layer as its bytes land
        if layer in state.deltanet:
            part = state.deltanet[layer]
            tensors[f"deltanet.{layer}.conv"], tensors[f"deltanet.{layer}.recurrent"] = part.conv, part.recurrent
        if layer in state.ple:
            part = state.ple[layer]
            tensors[f"ple.{layer}.context"], tensors[f"ple.{layer}.conv"] = part.context, part.conv
        if layer in state.attention:
            cache = state.attention[layer]
            for name, tensor in zip(("keys", "values", "index_keys", "block_keys"),
                                    (cache.keys, cache.values, cache.index_keys, cache.block_keys)):
                tensors[f"attention.{layer}.{name}"] = tensor
            lengths[layer] = [cache.length, cache.blocks]
    if state.mtp_input is not None:
        tensors["mtp_input"] = state.mtp_input
    tensors = {name: _contiguous_on_host(tensor) for name, tensor in tensors.items()}
    header: dict[str, object] = {"__metadata__": {"position": str(state.position), "attention": json.dumps(lengths)}}
    offset = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format aligns the tensors' bytes to 8
    return [memoryview(len(text).to_bytes(8, "little") + text)] + [
        memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) for tensor in tensors.values() if tensor.numel()]


def _contiguous_on_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the host in one piece, copied by numpy where it is strided (an attention cache's
    filled part): encoding runs on the stored states' writer thread, and a torch copy there would
    start a second OpenMP team, which slows the engine's own CPU work severalfold on a small machine."""
    tensor = tensor.detach().to("cpu")
    if tensor.is_contiguous():
        return tensor
    raw = tensor.view(torch.uint8).numpy()  # the last dimension is contiguous: a byte view keeps it so
    return torch.from_numpy(np.ascontiguousarray(raw)).view(tensor.dtype)


def decode_state(data, like: SequenceState, on_host: bool = False) -> SequenceState:
    """The state `data` holds (a bytearray or a numpy uint8 array: a stored entry's decompressed
    frames), on `like`'s devices; `like` is a fresh state of the same model. The tensors are read as
    views of `data`, not copied: a state is read once, into `like`'s devices, or with `on_host` left
    where `data` is, views all (data in pinned memory: the state is a live entry as it stands)."""
    try:
        tensors = _views(data)
        metadata = _metadata(data)
        position = int(metadata["position"])
        lengths = {int(layer): value for layer, value in json.loads(metadata["attention"]).items()}
    except Exception as error:  # safetensors raises its own types for bytes it cannot read
        raise StateFormatError(f"not a stored state: {error}") from None
    expected = {f"deltanet.{layer}.{name}" for layer in like.deltanet for name in ("conv", "recurrent")}
    expected |= {f"ple.{layer}.{name}" for layer in like.ple for name in ("context", "conv")}
    expected |= {f"attention.{layer}.{name}" for layer in like.attention
                 for name in ("keys", "values", "index_keys", "block_keys")}
    mtp_input = tensors.pop("mtp_input", None)
    if set(tensors) != expected or set(lengths) != set(like.attention):
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise StateFormatError(f"the stored state's parts differ from this model's (missing {missing[:3]}, extra {extra[:3]})")
    found = lambda name, part: _like(tensors, name, part, on_host)  # noqa: E731
    deltanet = {layer: DeltaNetState(found(f"deltanet.{layer}.conv", part.conv),
                                     found(f"deltanet.{layer}.recurrent", part.recurrent))
                for layer, part in like.deltanet.items()}
    ple = {layer: PLEState(found(f"ple.{layer}.context", part.context), found(f"ple.{layer}.conv", part.conv))
           for layer, part in like.ple.items()}
    attention = {}
    for layer, cache in like.attention.items():
        length, blocks = lengths[layer]
        parts = [tensors[f"attention.{layer}.{name}"] for name in ("keys", "values", "index_keys", "block_keys")]
        shapes = [(cache.keys.shape[0], length, cache.keys.shape[2]), (cache.keys.shape[0], length, cache.keys.shape[2]),
                  (length, cache.index_keys.shape[1]), (blocks, cache.block_keys.shape[1])]
        for part, shape in zip(parts, shapes):
            if tuple(part.shape) != shape or part.dtype != cache.keys.dtype:
                raise StateFormatError(f"attention layer {layer}: a part of shape {tuple(part.shape)} {part.dtype}, "
                                       f"expected {shape} {cache.keys.dtype}")
        if on_host:
            attention[layer] = AttentionCache.viewing(*parts, cache.ratio, length, blocks)
        else:
            attention[layer] = AttentionCache.filled(*parts, cache.ratio, length, blocks, cache.keys.device)
    dtype = next(iter(like.attention.values())).keys.dtype
    if mtp_input is not None and (mtp_input.ndim != 2 or mtp_input.shape[0] != 1 or mtp_input.dtype != dtype):
        raise StateFormatError(f"mtp_input: {tuple(mtp_input.shape)} {mtp_input.dtype}, expected (1, hc * H) {dtype}")
    device = torch.device("cpu") if on_host else next(iter(like.attention.values())).keys.device
    return SequenceState(position, deltanet, attention, ple, None if mtp_input is None else mtp_input.to(device))


def _like(tensors: dict[str, torch.Tensor], name: str, like: torch.Tensor, on_host: bool) -> torch.Tensor:
    found = tensors[name]
    if found.shape != like.shape or found.dtype != like.dtype:
        raise StateFormatError(f"{name}: {tuple(found.shape)} {found.dtype}, expected {tuple(like.shape)} {like.dtype}")
    # the PLE token context lives on the host whatever the device
    return found if on_host else found.to(like.device)


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64, "I32": torch.int32}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def _views(data) -> dict[str, torch.Tensor]:
    """The safetensors bytes' tensors as views of `data`, each checked to fit its bytes (safetensors'
    own load copies every tensor: a second pass over a state of hundreds of MB)."""
    header_bytes = int.from_bytes(bytes(data[:8]), "little")
    header = json.loads(bytes(data[8:8 + header_bytes]))
    start, tensors = 8 + header_bytes, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (begin, end) = _DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
        count = int(np.prod(shape, dtype=np.int64))
        if not 0 <= begin <= end <= len(data) - start or end - begin != count * dtype.itemsize:
            raise ValueError(f"{name}: its bytes do not fit its shape")
        flat = torch.frombuffer(data, dtype=dtype, count=count, offset=start + begin) if count else torch.empty(0, dtype=dtype)
        tensors[name] = flat.view(shape)
    return tensors


def header_end(data) -> int:
    """Where the tensors' bytes begin: the bytes `decode_state` needs before any tensor's (`data`
    holds at least the first 8)."""
    return 8 + int.from_bytes(bytes(data[:8]), "little")


def layer_ends(data) -> dict[int, int]:
    """For each layer, where its last tensor's bytes end in `data` (whose header is in place): a
    state encoded layer by layer can be restored layer by layer as these bytes land."""
    start = header_end(data)
    ends: dict[int, int] = {}
    for name, entry in json.loads(bytes(data[8:start])).items():
        part, _, rest = name.partition(".")
        if part in ("deltanet", "ple", "attention"):
            layer = int(rest.partition(".")[0])
            ends[layer] = max(ends.get(layer, start), start + entry["data_offsets"][1])
    return ends


def _metadata(data) -> dict[str, str]:
    header = int.from_bytes(bytes(data[:8]), "little")
    return json.loads(bytes(data[8:8 + header]))["__metadata__"]
