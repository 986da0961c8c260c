"""Device maps: free memory and budgets, and the map itself (``infer_auto_device_map``)."""
