"""Tables prepared from a checkpoint: the table folder every command and ``from_pretrained`` share (:mod:`ple.convert.folder`), and dequantized checkpoint copies (:mod:`ple.convert.dequantized`)."""
