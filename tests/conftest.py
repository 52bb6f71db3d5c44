import json
import os
from pathlib import Path

import pytest
import torch

from tests.utils import tiny_model

# Tests build models with a fixed seed and compare against transformers; keep CPU threads modest
# so that parallel workers on a small machine do not oversubscribe it.
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):  # the marker, not the tests/gpu folder name
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """The built-in tiny model's directory."""
    return tiny_model()


@pytest.fixture(scope="module")
def vocab_size(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]
