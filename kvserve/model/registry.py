"""Model classes by Hugging Face architecture name (``config.architectures``).

Each family module decorates its causal-LM class with ``@register_model(name)``;
the family modules are imported on the first lookup, so importing the registry
costs nothing and a family can import the shared layers freely.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from kvserve.model.errors import ModelLoadError

if TYPE_CHECKING:
    from kvserve.model.layers import CausalLM

# One line per family: the modules whose classes register themselves on import.
FAMILY_MODULES = ("kvserve.model.llama", "kvserve.model.qwen2", "kvserve.model.qwen3")

_MODELS: dict[str, type[CausalLM]] = {}
_C = TypeVar("_C", bound="type[CausalLM]")


def register_model(architecture: str) -> Callable[[_C], _C]:
    """Class decorator: ``architecture`` (e.g. "LlamaForCausalLM") builds this class.
    Raises ValueError when the name is taken by another class."""

    def register(cls: _C) -> _C:
        if _MODELS.setdefault(architecture, cls) is not cls:
            raise ValueError(f"{architecture} is already registered to "
                             f"{_MODELS[architecture].__qualname__}")
        return cls

    return register


def supported_architectures() -> tuple[str, ...]:
    """Registered architecture names, in registration order."""
    for module in FAMILY_MODULES:
        importlib.import_module(module)
    return tuple(_MODELS)


def resolve_architecture(architectures: Sequence[str]) -> str:
    """The first of a config's ``architectures`` that is registered.
    Raises ModelLoadError naming the supported ones when none is."""
    supported = supported_architectures()
    found = next((a for a in architectures if a in supported), None)
    if found is None:
        raise ModelLoadError(
            f"unsupported architecture {list(architectures) or '(none given)'}; kvserve "
            f"supports {', '.join(supported)}"
        )
    return found


def get_model_class(architecture: str) -> type[CausalLM]:
    """The class registered for ``architecture``. Raises ModelLoadError (as above)."""
    return _MODELS[resolve_architecture([architecture])]
