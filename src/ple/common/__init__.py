"""The ground floor every level may use: reading and writing files, safetensors headers, checks across ranks, and argparse value types."""
