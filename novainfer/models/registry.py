"""One registry from Hugging Face architecture names to model classes."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


class UnsupportedArchitectureError(ValueError):
    pass


class _ModelRegistry:
    def __init__(self) -> None:
        self._models: dict[str, type[nn.Module]] = {}

    def register(self, architecture: str, model_cls: type[nn.Module]) -> None:
        self._models[architecture] = model_cls

    def get_supported_archs(self) -> list[str]:
        return sorted(self._models)

    def resolve(self, architectures: Sequence[str] | None) -> tuple[type[nn.Module], str]:
        """The class for the first supported name in a config's ``architectures`` list."""
        for arch in architectures or []:
            if arch in self._models:
                return self._models[arch], arch
        raise UnsupportedArchitectureError(
            f"model architecture(s) {list(architectures or [])} not supported; "
            f"supported architectures: {self.get_supported_archs()}")


ModelRegistry = _ModelRegistry()


def _register_builtin_models() -> None:
    from novainfer.models.llama import LlamaForCausalLM
    from novainfer.models.mock import MockForCausalLM
    from novainfer.models.qwen2 import Qwen2ForCausalLM

    ModelRegistry.register("LlamaForCausalLM", LlamaForCausalLM)
    ModelRegistry.register("Qwen2ForCausalLM", Qwen2ForCausalLM)
    ModelRegistry.register("NovaInferMockForCausalLM", MockForCausalLM)


_register_builtin_models()
