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
