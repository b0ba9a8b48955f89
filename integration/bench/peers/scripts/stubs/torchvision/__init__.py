"""Import-only stand-in for torchvision, for the SGLang peer venv (never installed there).

SGLang's radix-cache import chain (model configs -> internvl utils) and
transformers' video utils import ``torchvision``, ``torchvision.io``,
``torchvision.transforms`` and friends at module load. PyPI's torchvision does
not match the local CPU torch (it pulls another torch or fails to load its
ops), and nothing the peer benchmark runs uses it. This package satisfies
those imports only: every submodule named below exists, ``InterpolationMode``
is a real enum, and any other attribute is a placeholder that raises
``RuntimeError`` when called. It sits on ``PYTHONPATH`` of the SGLang peer
script only; it must never be on our own venv's path.
"""

from __future__ import annotations

import enum
import sys
import types
from typing import Any, NoReturn

__version__ = "0.0.0+hicache-stub"


class InterpolationMode(enum.Enum):
    """The names transformers and SGLang read at import time."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Placeholder:
    """Stands for any torchvision object; using it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(f"{self._name} is a stub: torchvision is not installed here")

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr == "InterpolationMode":
            return InterpolationMode
        return _Placeholder(f"{self.__name__}.{attr}")


_SUBMODULES = (
    "io",
    "ops",
    "models",
    "datasets",
    "utils",
    "transforms",
    "transforms.functional",
    "transforms.v2",
    "transforms.v2.functional",
)

for _sub in _SUBMODULES:
    _full = f"{__name__}.{_sub}"
    _mod = _StubModule(_full)
    _mod.__path__ = []  # a package, so deeper imports resolve through sys.modules
    sys.modules[_full] = _mod
    _parent_name, _, _leaf = _full.rpartition(".")
    setattr(sys.modules[_parent_name], _leaf, _mod)


def __getattr__(attr: str) -> Any:
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Placeholder(f"{__name__}.{attr}")
