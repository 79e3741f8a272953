"""The shard format and packing: index and tables, records and codecs, sources, the writer, inspect."""
