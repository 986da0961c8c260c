"""The lowest layer: devices, byte arithmetic, tensors and ties, meta-device model building, progress.

Everything else builds on these; nothing here imports another bigmodel subpackage.
"""
