"""Reading PLE layers from safetensors checkpoints, with one validation for every reader.

:mod:`ple.checkpoint.scan` lists a checkpoint's files and layers and every problem they have
(headers and small tensors only); :mod:`ple.checkpoint.load` reads what a clean scan found (weights,
tables, table files). The safetensors files themselves are read by :mod:`ple.common.safetensors`.
"""

from ple.checkpoint.load import (
    PLEWeights,
    iter_table_shards,
    load_ple_weights,
    load_table,
    open_layer_table,
    table_file_name,
    table_shards,
    write_layer_table,
)
from ple.checkpoint.scan import (
    INDEX_NAME,
    CheckpointScan,
    LayerEntry,
    check_checkpoint,
    checkpoint_files,
    resolve_model,
    scan_checkpoint,
)
from ple.common.safetensors import (
    SAFETENSORS_DTYPES,
    CheckpointError,
    PreadReader,
    SafetensorsHeader,
    TensorInfo,
    TensorReader,
    read_header,
    read_safetensors_header,
)

__all__ = [
    "CheckpointError",
    "LayerEntry",
    "CheckpointScan",
    "PLEWeights",
    "check_checkpoint",
    "scan_checkpoint",
    "load_ple_weights",
    "iter_table_shards",
    "read_safetensors_header",
    "read_header",
    "SafetensorsHeader",
    "TensorInfo",
    "checkpoint_files",
    "load_table",
    "PreadReader",
    "SAFETENSORS_DTYPES",
    "INDEX_NAME",
    "resolve_model",
    "table_shards",
    "table_file_name",
    "write_layer_table",
    "open_layer_table",
    "TensorReader",
]
