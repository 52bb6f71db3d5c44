"""What the core_api examples share: the command line for the model, and loading it with its tokenizer."""

from __future__ import annotations

import argparse

import torch

from novainfer.core_api import Batch, Model


def model_arguments(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=None, help="Hugging Face model directory (default: the built-in tiny model)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true",
                        help="recompute the results the plain way (each sequence decoded alone) and compare")
    return parser


def load(args: argparse.Namespace, n_ctx: int, n_seq_max: int):
    """(Model, tokenizer) for ``--model`` (or the built-in tiny model)."""
    from transformers import AutoTokenizer

    from novainfer.tiny_model import get_tiny_model_dir

    model_dir = args.model or str(get_tiny_model_dir())
    model = Model.from_pretrained(model_dir, device=args.device, dtype=args.dtype, n_ctx=n_ctx, n_seq_max=n_seq_max)
    return model, AutoTokenizer.from_pretrained(model_dir)


def check(code: int, model: Model) -> None:
    """Stops the example with decode's message unless it succeeded."""
    if code != 0:
        raise SystemExit(f"decode returned {code}: {model.last_error}")


def decode_alone(model: Model, tokens: list[int]) -> torch.Tensor:
    """Float32 logits [len(tokens), vocab] of ``tokens`` decoded alone in an emptied cache."""
    model.kv_clear()
    batch = Batch.init(len(tokens), 1)
    for i, token in enumerate(tokens):
        batch.add(token, i, [0], logits=True)
    check(model.decode(batch), model)
    return model.get_logits().clone()


def report_check(name: str, difference: float, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> None:
    """Stops the example when ``difference`` exceeds what the model's dtype explains: 1e-3, or two units of
    its precision at ``scale`` (the size of the compared values) for bfloat16/float16, where a batch of
    another shape rounds its matmuls differently."""
    tolerance = max(1e-3, 2 * torch.finfo(dtype).eps * scale)
    print(f"check: {name}: max difference {difference:.2e} (tolerance {tolerance:.2e})")
    if difference > tolerance:
        raise SystemExit(f"check failed: {name} differs by {difference:.2e} (tolerance {tolerance:.2e})")
