"""Where a model comes from: ``resolve_model`` turns what the user named (nothing, a
checkpoint folder, a ``.gguf`` file or a folder holding one) into a Hugging Face
checkpoint folder that ``kvserve.model.loader`` loads, with the name to serve it under
and whether its weights are random.

Every failure is a ``ModelLoadError`` with a one-line message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvserve.model.errors import ModelLoadError

# config.json key that ``kvserve init-model`` writes: the weights are random, the text
# the model writes is meaningless (shown in /v1/models and on startup).
RANDOM_WEIGHTS_KEY = "kvserve_random_weights"


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """A loadable checkpoint folder.

    Attributes:
        path: folder with config.json, ``*.safetensors`` and tokenizer files.
        name: the name to serve it under (``/v1/models``), unless the user gives one.
        random_weights: the weights are random (``kvserve init-model``, or the tiny
            fallback when the default model is not installed).
        source: what it was made from, for messages (the folder, a ``.gguf`` file...).
        note: one line to say on startup (why a fallback was taken), or None.
    """

    path: Path
    name: str
    random_weights: bool
    source: str
    note: str | None = None


def has_random_weights(folder: Path) -> bool:
    """Whether ``folder/config.json`` carries the random-weights mark."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get(RANDOM_WEIGHTS_KEY) is True


def resolve_model(model: str | Path | None) -> ResolvedModel:
    """The checkpoint folder for ``model``.

    ``None`` is the default model. A folder is used as it is. Raises ModelLoadError
    (one line) when ``model`` does not exist.
    """
    if model is None:
        from kvserve.model.init import default_model_dir

        path = default_model_dir()
        return ResolvedModel(path, path.name, True, str(path),
                             note="the tiny random-weight default model (its text is "
                             "meaningless)")
    path = Path(model)
    if not path.exists():
        raise ModelLoadError(f"model {path} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model {path} is not a checkpoint folder")
    return ResolvedModel(path, path.absolute().name, has_random_weights(path), str(path))
