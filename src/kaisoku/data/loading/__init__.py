"""Loading: the sharded and image-folder datasets, the shard loader and its batch path, transforms, counters."""
