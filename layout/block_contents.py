"""What lies in each hashed block of a pack file, so a failing block is named by its contents:
the dense or vision tensors it overlaps, or the PLE layer and rows it holds."""

from __future__ import annotations

import bisect
from collections.abc import Callable

from flashpack.layout.manifest import Manifest, TensorEntry

_NAMED_TENSORS = 3  # a block of small tensors (norms) can hold hundreds: name a few and count the rest


def block_contents(manifest: Manifest, path: str, block_bytes: int) -> Callable[[int], str] | None:
    """block index -> a short description of what it holds, or None for a file of no known layout."""
    dense = manifest.document["dense"]
    if path == dense["file"]:
        return _tensor_blocks(manifest.dense_tensors(), block_bytes)
    vision = manifest.document.get("vision")
    if vision and path == vision["file"]:
        return _tensor_blocks(manifest.vision_tensors(), block_bytes)
    for table in manifest.ple_tables():
        if table.file == path:
            def ple_rows(block: int, table=table) -> str:
                first = block * block_bytes // table.row_stride
                last = min(table.rows, -(-(block + 1) * block_bytes // table.row_stride)) - 1
                return f"PLE layer {table.layer}, rows {first}-{last}"
            return ple_rows
    return None


def _tensor_blocks(tensors: dict[str, TensorEntry], block_bytes: int) -> Callable[[int], str]:
    ordered = sorted(tensors.values(), key=lambda entry: entry.offset)
    ends = [entry.offset + entry.length for entry in ordered]

    def describe(block: int) -> str:
        start, stop = block * block_bytes, (block + 1) * block_bytes
        names = []
        for index in range(bisect.bisect_right(ends, start), len(ordered)):
            if ordered[index].offset >= stop:
                break
            if ordered[index].length:
                names.append(ordered[index].name)
        if not names:
            return "safetensors header"
        shown = ", ".join(names[:_NAMED_TENSORS])
        more = f" and {len(names) - _NAMED_TENSORS} more" if len(names) > _NAMED_TENSORS else ""
        header = "safetensors header, " if start < ordered[0].offset else ""  # names is non-empty here
        return f"{header}tensor{'s' if len(names) > 1 else ''} {shown}{more}"

    return describe
