"""The one rule every package root follows (issue 21): `__all__` names exist, none is private, and no two names are
bound to one object (an alias for a seed or upstream spelling belongs in the package's `upstream` module)."""

from __future__ import annotations

from collections import defaultdict
from types import ModuleType

# Values such as False, 0 or "" are shared objects in Python: equal flags and constants are not aliases.
_IMMUTABLE_VALUES = (bool, int, float, str, bytes, type(None))


def root_api_problems(package: ModuleType) -> list[str]:
    """Every way `package.__all__` breaks the rule, one line each; [] when it holds."""
    names = list(package.__all__)
    problems = []
    if len(set(names)) != len(names):
        problems.append(f"names listed twice in __all__: {sorted({n for n in names if names.count(n) > 1})}")
    missing = [name for name in names if not hasattr(package, name)]
    if missing:
        problems.append(f"__all__ lists names the package does not define: {missing}")
    private = [name for name in names if name.startswith("_") and name != "__version__"]
    if private:
        problems.append(f"private names in __all__: {private}")
    names_by_object: dict[int, list[str]] = defaultdict(list)
    for name in names:
        value = getattr(package, name, None)
        if name not in missing and not isinstance(value, _IMMUTABLE_VALUES):
            names_by_object[id(value)].append(name)
    aliases = [group for group in names_by_object.values() if len(set(group)) > 1]
    if aliases:
        problems.append(f"names bound to one object (keep one; other spellings go to `upstream`): {aliases}")
    return problems
