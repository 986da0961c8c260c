"""The order in which a dispatched model's offloading hooks run: guessed first, then recorded.

Before the first forward the order is a guess: the hooks in the order of their modules in the
model (``model.modules()``: registration order, which is the device map's order for a
transformers model and the execution order of a decoder stack).  The first forward records the
order the hooks actually run in; when the model's next forward starts (or a hook runs a second
time), the recorded order replaces the guess.  Reading ahead along the guess during the first forward
only decides which bytes are read early: a wrong guess costs reads, never a value.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any


def staged_bytes(hook: Any) -> int:
    """Bytes ``hook`` puts in at its forward (its members' included)."""
    size = getattr(hook, "staged_bytes", None)
    return hook.offloaded_bytes if size is None else size


class ExecutionOrder:
    """Hooks in execution order: a guess until the first forward has been recorded.

    Args:
        guess: the hooks in their expected execution order (empty: none is read ahead until the
            first forward has been recorded).

    Attributes:
        refs: weak references to the hooks of the order in use.
        sizes: each hook's staged bytes, in the order of ``refs``.
        position: ``id(hook)`` → its index in ``refs``.
        largest: bytes of the largest hook in the order (0 when empty).
        recording: True until the first forward's order is known.
    """

    def __init__(self, guess: Iterable[Any] = ()) -> None:
        self.recording = True
        self._recorded: list[weakref.ref] = []
        self._seen: set[int] = set()
        self._use([weakref.ref(hook) for hook in guess])

    def _use(self, refs: list[weakref.ref]) -> None:
        hooks = [ref() for ref in refs]
        self.refs = refs
        self.sizes = [0 if hook is None else staged_bytes(hook) for hook in hooks]
        self.position = {id(hook): i for i, hook in enumerate(hooks) if hook is not None}
        self.largest = max(self.sizes, default=0)

    @property
    def recorded_length(self) -> int:
        """Number of hooks recorded so far (all of the first forward's, once it has ended)."""
        return len(self._recorded)

    @property
    def at_start(self) -> bool:
        """True before any hook has run (the next one to run starts the first forward)."""
        return not self._recorded

    def observe(self, hook: Any) -> bool:
        """Note that ``hook``'s module starts.

        Returns:
            True when this ends the recording (the recorded order replaces the guess, even an equal
            one: what was planned along the guess is to be learned again, e.g. the file spans of
            offloaded values whose files were first mapped during the first forward), else False.
        """
        if not self.recording:
            return False
        key = id(hook)
        if key not in self._seen:
            self._seen.add(key)
            self._recorded.append(weakref.ref(hook))
            return False
        return self.finish()

    def restart(self) -> None:
        """The forward being recorded raised: what it recorded is dropped, the next forward records again
        (a first forward interrupted at its sixth of ten offloaded modules would otherwise leave an order of
        six for good: the other four never read ahead, never released)."""
        if self.recording:
            self._recorded, self._seen = [], set()

    def finish(self) -> bool:
        """End the recording (the model's next forward starts): the recorded order replaces the guess.

        Returns:
            True when this ended it, False when it had ended already or nothing was recorded yet.
        """
        if not self.recording or not self._recorded:
            return False
        self.recording = False
        self._use(self._recorded)  # sizes read again: tensors may have been registered since the guess
        return True
