"""Checkpoint files: resolving plain, sharded and hub-cache folders safely and reading tensors lazily."""
