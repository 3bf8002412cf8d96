"""Token input (token files, text, the built-in real text, and how text reaches a model's
vocabulary: :mod:`ple.data.tokens`) and the row traffic statistics of a token stream."""
