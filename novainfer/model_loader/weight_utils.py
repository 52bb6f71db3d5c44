"""Walking the safetensors files of a Hugging Face model directory."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's shard files: those an index names, else every ``*.safetensors``."""
    model_dir = Path(model_dir)
    index = model_dir / SAFE_WEIGHTS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index.name} names shard files that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {model_dir}")
    return files


def iterate_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(name, tensor)`` for every tensor of every shard, one tensor in memory at a time."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
