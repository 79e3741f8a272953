"""Process groups, data parallelism, pipelines and meshes on torch.distributed."""
