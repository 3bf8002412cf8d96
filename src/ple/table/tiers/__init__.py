"""Where a table lives: memory, pinned host memory, a memory map, a row cache over a slower tier, direct reads, rows sharded across ranks, and adapted tables (trained rows over a base)."""
