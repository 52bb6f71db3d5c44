"""Writes a draft model for speculative decoding: a copy of a checkpoint cut to its first layers.

The copy keeps the target's embeddings, final norm, LM head and tokenizer, so it shares the
target's vocabulary, and agrees with it as far as its first layers already decide the next token
(measure the acceptance; never assume it):

    python benchmarks/draft_model.py TARGET_DIR DRAFT_DIR --num-layers 4
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
                parts = name.split(".")
                if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                    continue
                kept[name] = f.get_tensor(name)
    save_file(kept, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="the target's Hugging Face directory")
    p.add_argument("out", help="directory to write the draft to")
    p.add_argument("--num-layers", type=int, required=True, help="decoder layers the draft keeps")
    args = p.parse_args(argv)
    print(write_truncated_copy(args.model, args.out, args.num_layers))


if __name__ == "__main__":
    main()
