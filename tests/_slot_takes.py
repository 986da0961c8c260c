"""Records which modules' values were taken from direct-read slots (bigmodel.offload.direct.Streams.take)."""

from __future__ import annotations

import pytest

from bigmodel.offload import direct


class Takes:
    """Counts, per hook id, the values taken from slots."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.served: list[int] = []
        take = direct.Streams.take

        def taking(streams, key):
            values = take(streams, key)
            if values is not None:
                self.served.append(key)
            return values

        monkeypatch.setattr(direct.Streams, "take", taking)
