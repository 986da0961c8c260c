"""Running a model along a device map: dispatch_model, whole-model CPU/disk offload, re-dispatch, prefetch."""
