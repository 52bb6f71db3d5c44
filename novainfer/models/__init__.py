from novainfer.models.registry import ModelRegistry, UnsupportedArchitectureError

__all__ = ["ModelRegistry", "UnsupportedArchitectureError"]
