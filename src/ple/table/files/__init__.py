"""The table file: its reader and writer, shard writer, verification, and conversion of a layer's table into a table file."""
