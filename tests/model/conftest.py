import pytest
import torch

from kvserve.model.init import init_model

SHAPES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {shape: init_model(root / shape, shape, seed=0) for shape in SHAPES}


@pytest.fixture(scope="session")
def hf_models(checkpoints):
    from transformers import AutoModelForCausalLM

    return {s: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
            for s, p in checkpoints.items()}
