"""The package root is the core API: every name in `am_precision.__all__` exists, none is private, and no two names
are bound to one object (an alias for a seed or upstream spelling belongs in an `upstream` module, not here)."""

from __future__ import annotations

from collections import defaultdict

import am_precision

# Values such as False, 0 or "" are shared objects in Python: equal flags and constants are not aliases.
_IMMUTABLE_VALUES = (bool, int, float, str, bytes, type(None))


def test_every_root_name_exists_and_is_public() -> None:
    assert len(set(am_precision.__all__)) == len(am_precision.__all__), "a name is listed twice in __all__"
    missing = [name for name in am_precision.__all__ if not hasattr(am_precision, name)]
    assert not missing, f"__all__ lists names the package does not define: {missing}"
    private = [name for name in am_precision.__all__ if name.startswith("_") and name != "__version__"]
    assert not private, f"private names in __all__: {private}"


def test_no_two_root_names_are_bound_to_one_object() -> None:
    names_by_object: dict[int, list[str]] = defaultdict(list)
    for name in am_precision.__all__:
        value = getattr(am_precision, name)
        if not isinstance(value, _IMMUTABLE_VALUES):
            names_by_object[id(value)].append(name)
    aliases = [names for names in names_by_object.values() if len(names) > 1]
    assert not aliases, f"names bound to one object (keep one; other spellings go to an upstream module): {aliases}"
