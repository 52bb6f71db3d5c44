from novainfer.model_loader.loader import WeightLoadingError, build_model, load_model, load_weights
from novainfer.model_loader.weight_utils import iterate_weights, safetensors_files

__all__ = ["WeightLoadingError", "build_model", "iterate_weights", "load_model", "load_weights", "safetensors_files"]
