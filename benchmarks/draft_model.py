"""Writes a draft model for speculative decoding: a copy of a checkpoint cut to its first layers.

The copy keeps the target's embeddings, final norm, LM head and tokenizer, so it shares the
target's vocabulary, and agrees with it as far as its first layers already decide the next token
(measure the acceptance; never assume it):

    python benchmarks/draft_model.py TARGET_DIR DRAFT_DIR --num-layers 4

A checkpoint of random weights gives a draft that never agrees with its target. To time the
draft-model path at a known, high agreement, ``--damped-target DIR --damping F`` also writes a copy of
the target whose layers past the draft's add only F times their output to the residual stream (their
``o_proj`` and ``down_proj`` scaled by F): the same shapes and cost as the target, with next tokens
mostly decided by the layers the draft shares.
    python benchmarks/spec_decode.py --model TARGET_DIR --speculative-config \\
        '{"method": "draft_model", "model": "DRAFT_DIR", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def write_truncated_copy(model_dir: str | Path, out_dir: str | Path, num_layers: int) -> Path:
    """Writes ``model_dir`` (a Hugging Face directory of safetensors) with only its decoder layers
    0 .. ``num_layers`` - 1 to ``out_dir``; returns ``out_dir``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = json.loads((model_dir / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {config['num_hidden_layers']}] (the model's layers), "
                         f"got {num_layers}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for file in model_dir.iterdir():  # tokenizer, generation config, chat template
        if file.is_file() and file.name != "config.json" and not file.name.endswith((".safetensors", ".index.json")):
            shutil.copy(file, out_dir / file.name)
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:num_layers]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    kept = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                layer = _layer_index(name)
                if layer is not None and layer >= num_layers:
                    continue
                kept[name] = f.get_tensor(name)
    save_file(kept, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else None


def write_damped_copy(model_dir: str | Path, out_dir: str | Path, first_layer: int, factor: float) -> Path:
    """Writes ``model_dir`` to ``out_dir`` with the output projections (``o_proj``, ``down_proj``) of
    decoder layers ``first_layer`` and later scaled by ``factor``; returns ``out_dir``."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for file in model_dir.iterdir():
        if file.is_file() and not file.name.endswith((".safetensors", ".index.json")):
            shutil.copy(file, out_dir / file.name)
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                layer = _layer_index(name)
                if layer is not None and layer >= first_layer and name.endswith(("o_proj.weight", "down_proj.weight")):
                    tensor = (tensor.to(torch.float32) * factor).to(tensor.dtype)
                tensors[name] = tensor
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="the target's Hugging Face directory")
    p.add_argument("out", help="directory to write the draft to")
    p.add_argument("--num-layers", type=int, required=True, help="decoder layers the draft keeps")
    p.add_argument("--damped-target", default=None,
                   help="also write the target with its later layers damped to this directory")
    p.add_argument("--damping", type=float, default=0.05,
                   help="--damped-target: factor on the later layers' output projections")
    args = p.parse_args(argv)
    print(write_truncated_copy(args.model, args.out, args.num_layers))
    if args.damped_target:
        print(write_damped_copy(args.model, args.damped_target, args.num_layers, args.damping))


if __name__ == "__main__":
    main()
