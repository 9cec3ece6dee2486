"""A package's API names loaded on first use (PEP 562's module `__getattr__`), shared by
`lmqtt.store` and `lmqtt.lightqueue`: importing one part of a package (the SDK in
`lmqtt.store.client`, the light queues' topic rules a gateway names) must not load the whole
engine with it (the CommitLog, RocksDB: tests/architecture/test_runtime_imports.py)."""
from __future__ import annotations

from importlib import import_module
from typing import Any, Callable


def lazy_exports(package: str, where: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The `__getattr__` of `package`: `where` maps each API name to the relative module that
    defines it; a name is imported when first asked and then kept in the package's `namespace`
    (its globals()), so the next lookup does not come here."""
    def __getattr__(name: str) -> Any:
        mod = where.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(mod, package), name)
        namespace[name] = value
        return value
    return __getattr__
