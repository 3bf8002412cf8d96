"""Token input (token files, text files, real text mapped into a model's vocabulary) and row-traffic statistics of a token stream."""
