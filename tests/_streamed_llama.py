"""The streamed 10-layer wide Llama of the streaming read-ahead tests (test_streaming_readahead,
test_direct_streaming, test_direct_streaming_attacks): its device map, input and memory budget.

10 blocks of 15.8 MB (tests/_page_cache.write_wide_llama): 158 MB offloaded > 0.8 x 180 MB, so the model
streams; kept: the last block (no module starts after it) and, in 0.5 x 180 MB - 2 windows of one block =
58 MB, three blocks spaced evenly over the others.
"""

from __future__ import annotations

import torch

BLOCKS = [f"model.layers.{i}" for i in range(10)]
MAP = {"model.embed_tokens": "cpu", **dict.fromkeys(BLOCKS, "disk"), "model.norm": "cpu", "model.rotary_emb": "cpu",
       "lm_head": "cpu"}  # fmt: skip
IDS = torch.tensor([[5, 6, 7, 8, 9]])
AVAILABLE = 180_000_000
KEPT = ["model.layers.1", "model.layers.4", "model.layers.7", "model.layers.9"]
RELEASED = [name for name in BLOCKS if name not in KEPT]
