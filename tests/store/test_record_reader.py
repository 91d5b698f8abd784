"""RecordReader: a single record read in parts at once gives the bytes one read gives, counts a
file that ends inside the record, and falls back from O_DIRECT once when every part is refused."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from flashpack.runtime.store import reader as reader_module
from flashpack.runtime.store.reader import MIN_PIECE, PAGE, RecordReader, aligned_empty

RECORD = 676 * PAGE  # a real-model record's stride (2,768,896 bytes)


@pytest.fixture
def record_file(tmp_path) -> tuple[Path, bytes]:
    """Two records and a third that ends 5,000 bytes in (a file's last record may end before its stride)."""
    data = os.urandom(2 * RECORD + 5000)
    (tmp_path / "experts.bin").write_bytes(data)
    return tmp_path, data


def _read(root: Path, offset: int, need: int, pieces: int, direct: bool = False) -> bytes:
    reader = RecordReader(root, ["experts.bin"], direct=direct, pieces=pieces)
    try:
        buffer = aligned_empty(RECORD)
        reader.read("experts.bin", offset, [buffer], need=need)
        return bytes(buffer.numpy()[:need])
    finally:
        reader.close()


def test_parts_cover_the_buffer_page_aligned():
    reader = RecordReader(Path("."), [], direct=False, pieces=4)
    try:
        view = memoryview(bytearray(RECORD))
        parts = reader._parts(view)
        assert len(parts) == 4
        assert all(start % PAGE == 0 for start, _ in parts)
        assert [start for start, _ in parts] == sorted({start for start, _ in parts})
        assert sum(len(part) for _, part in parts) == RECORD
        assert len(reader._parts(memoryview(bytearray(MIN_PIECE)))) == 1  # too small to split
    finally:
        reader.close()


@pytest.mark.parametrize("pieces", [1, 4])
def test_a_record_read_in_parts_has_the_files_bytes(record_file, pieces):
    root, data = record_file
    assert _read(root, RECORD, RECORD, pieces) == data[RECORD:2 * RECORD]
    # the last record: the parts past the file's end read nothing, the first ones count
    assert _read(root, 2 * RECORD, 5000, pieces) == data[2 * RECORD:]


def test_a_record_cut_short_is_an_error_not_a_partial_record(record_file):
    root, _ = record_file
    with pytest.raises(OSError, match="short read: 5000 of 6000 bytes"):
        _read(root, 2 * RECORD, 6000, pieces=4)


def test_parts_refused_o_direct_fall_back_once_and_read_right(record_file, monkeypatch):
    """The filesystem took the O_DIRECT open but refuses the reads: every part hits EINVAL at once."""
    if not reader_module.O_DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    root, data = record_file
    real_preadv, direct_fds = os.preadv, set()
    real_open = os.open

    def tracking_open(path, flags, *args):
        fd = real_open(path, flags, *args)
        if flags & reader_module.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def refusing_preadv(fd, views, offset):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, views, offset)

    monkeypatch.setattr(reader_module.os, "open", tracking_open)
    monkeypatch.setattr(reader_module.os, "preadv", refusing_preadv)
    reader = RecordReader(root, ["experts.bin"], direct=True, pieces=4)
    try:
        buffer = aligned_empty(RECORD)
        reader.read("experts.bin", 0, [buffer], need=RECORD)
        assert bytes(buffer.numpy()) == data[:RECORD]
        assert not reader.direct and "refused an O_DIRECT read" in reader.fallback_reason
    finally:
        reader.close()
