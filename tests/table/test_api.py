import ple.table as table


def test_public_api_is_pinned():
    assert sorted(table.__all__) == sorted(
        [
            "CachedTable",
            "DEFAULT_CACHE_ROWS",
            "DEFAULT_MEMORY_BUDGET",
            "DEFAULT_TIER",
            "DirectTable",
            "FILE_TIERS",
            "FORMATS",
            "IdOutOfRangeError",
            "MODEL_TIERS",
            "MemoryTable",
            "MmapTable",
            "PinnedHostTable",
            "PrefetchError",
            "ShardGeometryError",
            "ShardedLookupError",
            "ShardedTable",
            "StoredTable",
            "TABLE_SUFFIX",
            "TIERS",
            "Table",
            "TableFileError",
            "UringUnavailable",
            "dequantize",
            "format_info",
            "open_table",
            "quantize_rows",
            "read_table_header",
            "verify_table_file",
        ]
    )
    for name in table.__all__:
        assert hasattr(table, name), name
    assert table.FORMATS == (
        "bf16", "fp16", "fp32", "fp8", "fp8_row", "int8_row",
        "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl", "mxfp4", "nvfp4",
    )  # fmt: skip
