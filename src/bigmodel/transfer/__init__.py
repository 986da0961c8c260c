"""Host-to-device transfers: pinned host memory, the staging ring and side-stream copies."""
