"""Which entry of a device map covers a tensor name: the longest matching prefix (``""`` covers everything)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping


def name_prefixes(name: str) -> Iterator[str]:
    """``"a.b.c"`` → ``"a.b.c"``, ``"a.b"``, ``"a"``, ``""``: the keys that can cover a name in a device map."""
    while True:
        yield name
        if not name:
            return
        name = name.rpartition(".")[0]


class UncoveredTensorError(KeyError, ValueError):
    """A device map gives no device to some tensors (their names are in the message).

    Both a :class:`KeyError` (a lookup in the map failed) and a :class:`ValueError`: accelerate
    raises ``ValueError`` for a tensor without a device, and code written for it catches that.
    """

    def __str__(self) -> str:  # the message as given (KeyError would quote it)
        return str(self.args[0]) if self.args else ""


def device_of(name: str, device_map: Mapping[str, object]) -> object:
    """The device a device map gives to ``name`` (longest matching prefix; ``""`` covers everything).

    Raises:
        UncoveredTensorError: if no entry of the map covers ``name`` (a KeyError and a ValueError).
    """
    for prefix in name_prefixes(name):
        if prefix in device_map:
            return device_map[prefix]
    raise UncoveredTensorError(f"{name!r} is not covered by the device map; add it or one of its parent modules.")


def is_covered(name: str, device_map: Mapping[str, object] | set[str]) -> bool:
    """True if an entry of the device map (or a set of its keys) covers ``name`` (itself or a parent; ``""`` all)."""
    return any(prefix in device_map for prefix in name_prefixes(name))


def check_covered(names: Iterable[str], device_map: Mapping[str, object], owner: str) -> None:
    """Raise one error naming every name of ``names`` the device map does not cover.

    Args:
        names: tensor names (e.g. the keys of a model's state dict).
        device_map: module/tensor name → device.
        owner: what the names belong to, for the message (e.g. the model's class name).

    Raises:
        UncoveredTensorError: the first 10 uncovered names, their count, and the fix.
    """
    missing = [name for name in names if not is_covered(name, device_map)]
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise UncoveredTensorError(
            f"The device map does not cover {len(missing)} parameters/buffers of {owner}: {shown}. "
            "Add them, or a module containing them, to the device map." + _misspelt_keys(missing, device_map)
        )


def _misspelt_keys(missing: list[str], device_map: Mapping[str, object]) -> str:
    """A sentence naming the map's keys that are not strings, or would cover a missing name without their
    spaces or end dots (``"lm_head."``, ``" lm_head"``), and the fix; empty when there is none."""
    odd = [
        key for key in device_map
        if not isinstance(key, str)
        or (key.strip().strip(".") != key and any(is_covered(name, {key.strip().strip(".")}) for name in missing))
    ]  # fmt: skip
    if not odd:
        return ""
    return (
        f" The map's key(s) {', '.join(repr(key) for key in odd[:10])} cover nothing: keys are module names as "
        "strings, without spaces or a dot at either end (e.g. 'model.layers.0')."
    )
