"""The node cache: the pure staging planner, the cache's control files and reader, the stager thread."""
