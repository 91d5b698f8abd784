"""Start-up reads of many records (bulk_read.py): the same bytes as the pack's, in order, checked."""

from __future__ import annotations

import pytest
import torch

from flashpack.errors import PackDamageError
from flashpack.layout.manifest import ExpertRecordEntry
from flashpack.layout.pack import Pack
from flashpack.runtime.store.bulk_read import plan_batches, read_records_in_batches
from flashpack.runtime.store.reader import RecordReader


def _entry(file: str, offset: int) -> ExpertRecordEntry:
    return ExpertRecordEntry(layer=0, expert=offset, file=file, offset=offset, length=10, xxh64="0" * 16)


def test_batches_are_runs_of_back_to_back_records_of_one_file_within_the_size():
    stride = 4096
    records = [_entry("a", 0), _entry("a", 4096), _entry("a", 8192), _entry("a", 16384), _entry("b", 20480),
               _entry("b", 24576), _entry("b", 28672)]
    batches = plan_batches(records, stride, batch_bytes=2 * stride)
    assert [[r.offset for r in b.records] for b in batches] == [[0, 4096], [8192], [16384], [20480, 24576], [28672]]
    assert [b.first_row for b in batches] == [0, 2, 3, 4, 6]


def _sorted_records(pack: Pack) -> list[ExpertRecordEntry]:
    return sorted(pack.manifest.expert_records(), key=lambda r: (r.file, r.offset))


@pytest.mark.parametrize("direct", [True, False], ids=["o-direct", "page-cache"])
def test_every_record_arrives_whole_and_in_order_through_reused_buffers(store_pack, copy_pack, direct_io_dir, direct):
    pack = Pack.open(copy_pack(store_pack, direct_io_dir))
    records = _sorted_records(pack)
    stride = pack.manifest.document["experts"]["record_stride"]
    got = torch.full((len(records), stride), 0xAB, dtype=torch.uint8)  # poisoned: a missed row shows
    seen_rows: list[int] = []

    def consume(batch, rows):
        seen_rows.extend(range(batch.first_row, batch.first_row + len(batch.records)))
        got[batch.first_row:batch.first_row + len(batch.records)] = rows

    reader = RecordReader(pack.root, sorted({r.file for r in records}), direct=direct, pieces=4, callers=3)
    try:
        # three records a batch: many batches through four buffers, so every buffer is reused
        read_records_in_batches(reader, records, stride, consume, threads=3, batch_bytes=3 * stride)
    finally:
        reader.close()
    assert seen_rows == list(range(len(records)))
    for row, record in enumerate(records):
        expected = bytes(pack.record_bytes(record.layer, record.expert))
        assert bytes(got[row, :record.length].numpy()) == expected
        assert not got[row, record.length:].any(), "bytes past a record's length must be zero"


def test_control_a_damaged_record_is_refused_by_name(store_pack, copy_pack, tmp_path, corrupt_record):
    root = copy_pack(store_pack, tmp_path)
    corrupt_record(root, 1, 5)
    pack = Pack.open(root)
    records = _sorted_records(pack)
    stride = pack.manifest.document["experts"]["record_stride"]
    reader = RecordReader(pack.root, sorted({r.file for r in records}), direct=False)
    try:
        with pytest.raises(PackDamageError, match="layer 1 expert 5"):
            read_records_in_batches(reader, records, stride, lambda batch, rows: None, batch_bytes=4 * stride)
        read_records_in_batches(reader, records, stride, lambda batch, rows: None, verify=False)  # asked not to check
    finally:
        reader.close()
