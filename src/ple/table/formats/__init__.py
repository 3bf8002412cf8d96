"""Storage formats of a table: the one table of formats (:mod:`ple.table.formats.catalog`), the block codecs, the encoders and the quantizers."""
