import ple


def test_public_api_is_pinned():
    assert sorted(ple.__all__) == sorted(
        [
            "PLEError",
            "PLEConfig",
            "ConfigError",
            "Layout",
            "ngram_ids",
            "next_ngram_context",
            "fresh_context",
            "NgramInputError",
            "load_ple_weights",
            "scan_checkpoint",
            "PLEWeights",
            "CheckpointError",
            "PLELayer",
            "Batch",
            "BatchError",
            "Session",
            "SessionError",
            "PrefixState",
            "tune_host_allocator",
            "Table",
            "StoredTable",
            "MemoryTable",
            "MmapTable",
            "PinnedHostTable",
            "CachedTable",
            "DirectTable",
            "ShardedTable",
        ]
    )
    for name in ple.__all__:
        assert getattr(ple, name) is not None


def test_import_does_not_load_triton_or_transformers():
    import subprocess
    import sys

    code = "import sys, ple; print('triton' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_every_file_tier_opens_alike(tmp_path):
    """``ple.DirectTable.open`` beside ``ple.MmapTable.open``: the same file, the same validation
    (a file of another layout is refused alike), the same rows."""
    import pytest
    import torch

    from ple.table import TableFileError
    from ple.table.files.table_file import TableFileWriter

    rows, hd = 3000, 24
    data = torch.randn(rows, hd)
    path = tmp_path / "t.pletable"
    with TableFileWriter(path, rows, hd, "fp32", 1024, {"name": "a"}) as w:
        for k in range(3):
            w.write_shard(k, data[k * 1024 : (k + 1) * 1024])
    mapped = ple.MmapTable.open(path, {"name": "a"})
    direct = ple.DirectTable.open(path, {"name": "a"}, memory_budget=1 << 16, queue_depth=2)
    try:
        assert isinstance(direct, ple.DirectTable) and isinstance(direct, ple.Table)
        assert direct.memory_budget == 1 << 16 and direct.queue_depth == 2
        ids = torch.randint(0, rows, (5, 7))
        want = mapped.lookup(ids, torch.float32)
        assert torch.equal(direct.lookup(ids, torch.float32), want) and torch.equal(want, data[ids].reshape(want.shape))
        for tier in (ple.MmapTable, ple.DirectTable):
            with pytest.raises(TableFileError, match="does not match the expected"):
                tier.open(path, {"name": "b"})
    finally:
        direct.close()
        mapped.close()
