"""Loading a checkpoint into a model along a device map, in one process or across torch.distributed ranks."""
