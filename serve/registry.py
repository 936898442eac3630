"""Classes chosen by name on the command line (``--tool-call-parser qwen``, ``--reasoning-parser qwen3``)."""
from __future__ import annotations


class Registry:

    def __init__(self, what: str):
        self.what = what
        self._classes: dict[str, type] = {}

    def register(self, *names: str):
        """A class decorator that registers the class under each of ``names``."""
        def wrap(cls: type) -> type:
            for name in names:
                self._classes[name] = cls
            return cls
        return wrap

    def names(self) -> list[str]:
        return sorted(self._classes)

    def get(self, name: str) -> type:
        if name not in self._classes:
            raise ValueError(f'{self.what} {name!r} is unknown: available are {", ".join(self.names())}')
        return self._classes[name]
