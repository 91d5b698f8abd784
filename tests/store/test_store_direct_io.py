"""Reads really go through O_DIRECT into page-aligned buffers where the filesystem supports it,
and fall back, saying why, where it does not (tmpfs)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flashpack.layout.pack import Pack
from flashpack.runtime.pack_source import PackExperts
from flashpack.runtime.store import build_store
from flashpack.runtime.store.config import StoreConfig
from flashpack.runtime.store.reader import O_DIRECT, aligned_empty

PAGE = 4096


def _fd_flags(fd: int) -> int:
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8)
    raise AssertionError("no flags in fdinfo")


def _cached_pages(path: Path) -> int:
    """Pages of `path` in the page cache (mincore over a private mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    pages = -(-size // PAGE)
    with open(path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        vector = (ctypes.c_ubyte * pages)()
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0:
            pytest.skip(f"mincore failed: {os.strerror(ctypes.get_errno())}")
        del address
        return sum(v & 1 for v in vector)
    finally:
        try:
            mapping.close()
        except BufferError:
            pass


def _drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd) if os.access(path, os.W_OK) else None
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_aligned_buffers():
    for size in (PAGE, 3 * PAGE, 100 * PAGE):
        assert aligned_empty(size).data_ptr() % PAGE == 0


@pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")
def test_reads_use_o_direct_with_aligned_buffers(store_pack, direct_io_dir, copy_pack):
    root = copy_pack(store_pack, direct_io_dir)
    pack = Pack.open(root)
    reference = PackExperts(Pack.open(root))
    stride = pack.manifest.document["experts"]["record_stride"]
    files = sorted({r.file for r in pack.manifest.expert_records()})
    for file in files:
        _drop_from_page_cache(root / file)
    with build_store(pack, StoreConfig(vram_budget=8 * stride, ram_budget=6 * stride), device_reserved=0) as store:
        assert store.transfers.reader.direct and store.transfers.reader.fallback_reason is None
        for file in files:  # the kernel holds our handles open with O_DIRECT
            assert _fd_flags(store.transfers.reader.fd(file)) & O_DIRECT
        for index in range(store.host_pool.slots):  # every read target is page-aligned
            assert store.host_pool.slot(index).data_ptr() % PAGE == 0
        # and the kernel enforces direct I/O on them: a misaligned buffer is refused
        misaligned = aligned_empty(stride + PAGE)[1:stride + 1]
        with pytest.raises(OSError) as error:
            os.preadv(store.transfers.reader.fd(files[0]), [memoryview(misaligned.numpy())], 0)
        assert error.value.errno == errno.EINVAL
        layers = sorted({r.layer for r in pack.manifest.expert_records()})
        for layer in layers:
            got = store.fetch(layer, [0, 1, 2])
            want = reference.fetch(layer, [0, 1, 2])
            assert all(torch.equal(got[e].down, want[e].down) for e in want)
        assert store.stats.total().disk_reads == 3 * len(layers)
        assert store.transfers.reader.bytes_read >= 3 * len(layers) * pack.manifest.document["experts"]["record_bytes"]
    # what the store read bypassed the page cache: look at records the reference's mmap never
    # touched (mapped pages stay cached), then the control: buffered reads do fill the cache
    entry = pack.record_entry(layers[0], 10)
    untouched = [10, 11, 12, 13]
    _drop_from_page_cache(root / entry.file)
    before = _cached_pages(root / entry.file)
    config = StoreConfig(vram_budget=8 * stride, ram_budget=6 * stride)
    with build_store(Pack.open(root), config, device_reserved=0) as store:
        store.fetch(layers[0], untouched)
    assert _cached_pages(root / entry.file) == before
    with build_store(Pack.open(root), replace(config, direct_io=False), device_reserved=0) as buffered:
        buffered.fetch(layers[0], untouched)
        assert buffered.transfers.reader.fallback_reason == "O_DIRECT turned off"
    assert _cached_pages(root / entry.file) >= before + len(untouched)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no tmpfs at /dev/shm")
def test_tmpfs_falls_back_to_buffered_reads_and_says_why(store_pack, copy_pack):
    shm = Path("/dev/shm") / f"flashpack-test-{os.getpid()}"
    shm.mkdir()
    try:
        root = copy_pack(store_pack, shm)
        pack = Pack.open(root)
        reference = PackExperts(Pack.open(root))
        stride = pack.manifest.document["experts"]["record_stride"]
        config = StoreConfig(vram_budget=8 * stride, ram_budget=2 * stride)
        with build_store(pack, config, device_reserved=0) as store:
            got = store.fetch(0, [3, 4])
            if store.transfers.reader.direct:
                pytest.skip("this tmpfs accepts O_DIRECT (Linux >= 6.6)")
            assert "does not support O_DIRECT" in store.transfers.reader.fallback_reason or \
                "refused an O_DIRECT read" in store.transfers.reader.fallback_reason
            want = reference.fetch(0, [3, 4])
            assert all(torch.equal(got[e].gate, want[e].gate) for e in want)
    finally:
        import shutil

        shutil.rmtree(shm, ignore_errors=True)


def test_filesystem_refusing_o_direct_falls_back_with_a_reason(store_pack, monkeypatch):
    """What tmpfs before Linux 6.6 and some network filesystems do: EINVAL on an O_DIRECT open."""
    from flashpack.runtime.store import reader as reader_module

    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(reader_module.os, "open", no_direct)
    pack = Pack.open(store_pack)
    stride = pack.manifest.document["experts"]["record_stride"]
    with build_store(pack, StoreConfig(vram_budget=8 * stride, ram_budget=2 * stride), device_reserved=0) as store:
        assert not store.transfers.reader.direct
        assert "does not support O_DIRECT (Invalid argument)" in store.transfers.reader.fallback_reason
        got = store.fetch(0, [3, 4])
    want = PackExperts(pack).fetch(0, [3, 4])
    assert all(torch.equal(got[e].gate, want[e].gate) for e in want)
