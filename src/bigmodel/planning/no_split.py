"""``no_split_module_classes`` as class names: a class object given there stands for its name.

Plans compare ``type(module).__name__`` with these names (the transformers convention:
``model._no_split_modules`` lists strings).  A class object (``[LlamaDecoderLayer]``) matches no
name, so accelerate 1.15 silently splits those modules; here it counts as its ``__name__``.  Any
other entry (``None``, a number, an instance) is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Iterable

NoSplit = Iterable["str | type"] | str | type | None


def no_split_names(no_split_module_classes: NoSplit) -> list[str] | None:
    """The class names of ``no_split_module_classes`` (None stays None), in the given order.

    Args:
        no_split_module_classes: class names or classes, a single one of either, or None.

    Returns:
        Their names (a class is given by its ``__name__``), or None.

    Raises:
        TypeError: an entry that is neither a string nor a class (names it and the fix).
    """
    if no_split_module_classes is None:
        return None
    given = [no_split_module_classes] if isinstance(no_split_module_classes, (str, type)) else no_split_module_classes
    try:
        entries = list(given)
    except TypeError:
        entries = [given]
    names = []
    for entry in entries:
        if isinstance(entry, str):
            names.append(entry)
        elif isinstance(entry, type):
            names.append(entry.__name__)
        else:
            shown = " ".join(repr(entry).split())[:60]  # one line, even for a module's repr
            raise TypeError(
                f"no_split_module_classes holds {shown} ({type(entry).__name__}), which is not a class name; "
                "give module class names such as ['LlamaDecoderLayer'] (or the classes themselves)."
            )
    return names
