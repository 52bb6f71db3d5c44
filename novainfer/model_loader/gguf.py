"""GGUF checkpoints (llama.cpp's single-file format): the model config, tensor names and weights.

A GGUF file carries the hyper-parameters and the tokenizer as metadata, and the tensors under
llama.cpp's names, usually quantized. The file is read with the ``gguf`` package; each tensor is
dequantized by ``gguf.quants.dequantize`` as it is loaded and handed, under its Hugging Face name,
to the same name -> parameter loading as a safetensors checkpoint (which converts it to the
engine's dtype and keeps this rank's shard). The engine then runs on plain dense weights: nothing
stays quantized. The tokenizer and chat template are rebuilt by transformers (see
``novainfer.tokenizer``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from novainfer.tiny_model import cache_root, write_once

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"


class GGUFError(ValueError):
    """A GGUF file that the engine cannot load; the message names what is not supported."""


@dataclass(frozen=True)
class GGUFArchitecture:
    """How a GGUF ``general.architecture`` maps onto a Hugging Face model."""

    hf_architecture: str
    model_type: str
    # llama.cpp's converter reorders the rows of each Q and K head of ``llama`` models (the two
    # rotary halves interleaved, the layout its RoPE kernel wants); loading puts them back.
    interleaved_qk_rows: bool


SUPPORTED_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", interleaved_qk_rows=True),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2", interleaved_qk_rows=False),
}

# llama.cpp's tensor names -> Hugging Face's (without the ".weight" / ".bias" suffix).
_MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Llama 3.x's RoPE scaling, which llama.cpp's converter stores as one factor per rotary frequency
# in this tensor (not a model parameter); the config gets back the parameters they were made from:
# the largest factor and Llama 3's published frequency bands.
ROPE_FACTORS_TENSOR = "rope_freqs.weight"
_LLAMA3_ROPE_BANDS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_TENSOR_NAME = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<base>\w+)\.(?P<suffix>weight|bias)")

# GGUF float tensor types whose dtype "auto" keeps; quantized weights have none (None: "auto" picks
# the device's preferred float type, see novainfer.config.preferred_dtype).
_FLOAT_TENSOR_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def is_gguf_file(path: str | os.PathLike) -> bool:
    return Path(path).suffix == GGUF_SUFFIX


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor.

    E.g. ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    match = _TENSOR_NAME.fullmatch(gguf_name)
    table = _MODEL_TENSORS if match is None or match["layer"] is None else _LAYER_TENSORS
    if match is None or match["base"] not in table:
        known = sorted(_MODEL_TENSORS) + [f"blk.N.{name}" for name in _LAYER_TENSORS]
        raise GGUFError(f"GGUF tensor {gguf_name!r} is not supported (known tensors: {known}, "
                        f"each .weight or .bias)")
    prefix = "" if match["layer"] is None else f"model.layers.{match['layer']}."
    return f"{prefix}{table[match['base']]}.{match['suffix']}"


@functools.cache
def _can_dequantize(qtype: Any) -> bool:
    """Whether ``gguf.quants.dequantize`` handles this tensor type (probed on one block of zeros)."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def supported_tensor_types() -> list[str]:
    from gguf import GGMLQuantizationType

    return [qtype.name for qtype in GGMLQuantizationType if _can_dequantize(qtype)]


@functools.lru_cache(maxsize=1)
def _open_reader(path: str, mtime_ns: int, size: int):
    """A parsed file, kept for the next caller in this process.

    Parsing the metadata of a large vocabulary takes seconds, and a process reads the same file
    twice in a row: for the config, then for the weights (which drop it when done).
    """
    from gguf import GGUFReader

    return GGUFReader(path)


class GGUFCheckpoint:
    """One GGUF file of a supported architecture, whose tensors all have supported types and names."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"GGUF file {str(self.path)!r} does not exist")
        stat = self.path.stat()
        try:
            self.reader = _open_reader(str(self.path), stat.st_mtime_ns, stat.st_size)
        except ValueError as exc:  # the gguf package's word for a malformed file
            raise GGUFError(f"{self.path.name} is not a readable GGUF file: {exc}") from exc
        self.architecture = str(self._field("general.architecture"))
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(f"{self.path.name}: GGUF architecture {self.architecture!r} is not supported; "
                            f"supported architectures: {sorted(SUPPORTED_ARCHITECTURES)}")
        self.spec = SUPPORTED_ARCHITECTURES[self.architecture]
        self.tensor_names = {tensor.name for tensor in self.reader.tensors}
        self._check_tensors()

    def _field(self, key: str, default: Any = ...) -> Any:
        field = self.reader.get_field(key)
        if field is None:
            if default is ...:
                raise GGUFError(f"{self.path.name}: metadata key {key!r} is missing")
            return default
        return field.contents()

    def _arch_field(self, key: str, default: Any = ...) -> Any:
        return self._field(f"{self.architecture}.{key}", default)

    def _check_tensors(self) -> None:
        """Every tensor must have a known name and a type gguf.quants can dequantize."""
        for name in sorted(self.tensor_names - {ROPE_FACTORS_TENSOR}):
            hf_tensor_name(name)
        unsupported: dict[str, list[str]] = defaultdict(list)
        for tensor in self.reader.tensors:
            if not _can_dequantize(tensor.tensor_type):
                unsupported[tensor.tensor_type.name].append(tensor.name)
        if unsupported:
            found = "; ".join(f"{qtype} ({len(names)} tensors, e.g. {names[0]})"
                              for qtype, names in sorted(unsupported.items()))
            raise GGUFError(f"{self.path.name} has tensor types that cannot be dequantized: {found}; "
                            f"supported tensor types: {supported_tensor_types()}")

    @property
    def num_heads(self) -> int:
        return int(self._arch_field("attention.head_count"))

    @property
    def num_kv_heads(self) -> int:
        return int(self._arch_field("attention.head_count_kv", self.num_heads))

    def _tensor(self, name: str):
        for tensor in self.reader.tensors:
            if tensor.name == name:
                return tensor
        raise GGUFError(f"{self.path.name} has no tensor {name!r}")

    def _vocab_size(self) -> int:
        # GGUF shapes list the fastest-varying dimension first: [hidden, vocab]
        return int(self._tensor("token_embd.weight").shape[-1])

    def _rope_scaling(self, theta: float, head_dim: int) -> dict[str, Any] | None:
        if ROPE_FACTORS_TENSOR in self.tensor_names:
            return self._llama3_rope_scaling(theta, head_dim)
        rope_type = self._arch_field("rope.scaling.type", "none")
        if rope_type == "none":
            return None
        scaling = {"rope_type": rope_type, "factor": float(self._arch_field("rope.scaling.factor"))}
        original = self._arch_field("rope.scaling.original_context_length", None)
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling

    def _llama3_rope_scaling(self, theta: float, head_dim: int) -> dict[str, Any]:
        from gguf.quants import dequantize

        tensor = self._tensor(ROPE_FACTORS_TENSOR)
        factors = dequantize(tensor.data, tensor.tensor_type).astype(np.float64)
        scaling = {"rope_type": "llama3", "factor": float(factors.max()), **_LLAMA3_ROPE_BANDS}
        expected = _llama3_rope_factors(theta, head_dim, **{k: v for k, v in scaling.items() if k != "rope_type"})
        if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-4):
            raise GGUFError(f"{self.path.name}: the RoPE factors in {ROPE_FACTORS_TENSOR} do not follow Llama 3's "
                            f"scaling ({scaling}); other per-frequency factors are not supported")
        return scaling

    def _eos_token_ids(self) -> list[int]:
        """End of text, of turn and of message: llama.cpp stops at each of them."""
        keys = ("eos_token_id", "eot_token_id", "eom_token_id")
        ids = [self._field(f"tokenizer.ggml.{key}", None) for key in keys]
        return list(dict.fromkeys(int(i) for i in ids if i is not None))

    def hf_config(self) -> PretrainedConfig:
        """The transformers config of the model, built from the file's metadata."""
        from transformers import AutoConfig

        hidden = int(self._arch_field("embedding_length"))
        head_dim = int(self._arch_field("attention.key_length", hidden // self.num_heads))
        rotary_dim = int(self._arch_field("rope.dimension_count", head_dim))
        if rotary_dim != head_dim:
            raise GGUFError(f"{self.path.name}: partial rotary embeddings (rope.dimension_count={rotary_dim}, "
                            f"head_dim={head_dim}) are not supported")
        theta = float(self._arch_field("rope.freq_base", 10000.0))
        eos = self._eos_token_ids()
        values: dict[str, Any] = {
            "architectures": [self.spec.hf_architecture],
            "hidden_size": hidden,
            "intermediate_size": int(self._arch_field("feed_forward_length")),
            "num_hidden_layers": int(self._arch_field("block_count")),
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": head_dim,
            "max_position_embeddings": int(self._arch_field("context_length")),
            "rope_theta": theta,
            "rope_scaling": self._rope_scaling(theta, head_dim),
            "rms_norm_eps": float(self._arch_field("attention.layer_norm_rms_epsilon")),
            "vocab_size": self._vocab_size(),
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "pad_token_id": self._field("tokenizer.ggml.padding_token_id", None),
            "dtype": self._weights_dtype(),
        }
        if self.architecture == "llama":  # Qwen2 always has Q/K/V biases; Llama says so in its config
            values["attention_bias"] = "blk.0.attn_q.bias" in self.tensor_names
        return AutoConfig.for_model(self.spec.model_type, **values)

    def _weights_dtype(self) -> str | None:
        """The float type of the file's matrices (norms are float32 in files of any type): None if
        any is quantized, float32 where they mix float types."""
        types = {tensor.tensor_type.name for tensor in self.reader.tensors if len(tensor.shape) > 1}
        if not types <= _FLOAT_TENSOR_DTYPES.keys():
            return None
        return _FLOAT_TENSOR_DTYPES[types.pop()] if len(types) == 1 else "float32"

    def tensor_index(self) -> dict[str, Any]:
        """What loading the weights needs of the file, as JSON: each parameter tensor's name, type, and
        the offset, dtype and shape of its data in the file (see :func:`iterate_gguf_weights`)."""
        tensors = [{"name": t.name, "type": int(t.tensor_type), "offset": int(t.data_offset),
                    "dtype": t.data.dtype.str, "shape": list(t.data.shape)}
                   for t in self.reader.tensors if t.name != ROPE_FACTORS_TENSOR]  # part of the config
        return {"architecture": self.architecture, "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                "tensors": tensors}


def _weights_of_index(path: Path, index: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(hf_name, float32 tensor)`` for each tensor of ``index``, read from the mapped file
    and dequantized one at a time."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    spec = SUPPORTED_ARCHITECTURES[index["architecture"]]
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    for tensor in index["tensors"]:
        dtype, shape = np.dtype(tensor["dtype"]), tensor["shape"]
        data = mapped[tensor["offset"]:tensor["offset"] + int(np.prod(shape)) * dtype.itemsize].view(dtype)
        array = dequantize(data.reshape(shape), GGMLQuantizationType(tensor["type"]))
        if not array.flags.writeable:  # float32 tensors come back as views of the mapped file
            array = np.array(array)
        weight = torch.from_numpy(array)
        if spec.interleaved_qk_rows and ".attn_q." in tensor["name"]:
            weight = _uninterleave_rotary_rows(weight, index["num_heads"])
        elif spec.interleaved_qk_rows and ".attn_k." in tensor["name"]:
            weight = _uninterleave_rotary_rows(weight, index["num_kv_heads"])
        yield hf_tensor_name(tensor["name"]), weight


def _llama3_rope_factors(theta: float, head_dim: int, factor: float, low_freq_factor: float,
                         high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """What each rotary frequency is divided by under Llama 3's RoPE scaling: 1 for short wavelengths,
    ``factor`` for long ones, a smooth blend in between."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    context = original_max_position_embeddings
    smooth = (context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < context / high_freq_factor, 1.0,
                    np.where(wavelen > context / low_freq_factor, factor, blended))


def _uninterleave_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's Q/K row order: per head, rows (a0, b0, a1, b1, ...) -> (a0, a1, ..., b0, b1, ...).

    Works for weights and biases alike (rows are the first dimension)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def derived_once(path: Path, kind: str, write: Callable[[Path], object], marker: str) -> Path | None:
    """A directory under the NovaInfer cache that ``write(directory)`` filled once with what is
    derived from the GGUF file ``path`` (``kind``: its config, its tokenizer, its tensor index),
    keyed by the file (path, size, modification time) and the transformers version that derived it;
    None where there is no such file (the caller's checkpoint names the error) or the cache cannot be
    written (the caller derives in place, as every time).

    Deriving parses the metadata, vocabulary and merge list included: 2.4 s for SmolLM2's file on a
    CPU with the gguf package, and transformers' tokenizer conversion parses it again, each time a
    process loads the model (a server's API process and its engine core each did)."""
    import transformers

    if not path.is_file():
        return None
    stat = path.stat()
    source = {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
              "transformers": transformers.__version__}
    key = hashlib.sha256(json.dumps(source).encode()).hexdigest()[:16]
    entry = cache_root() / "gguf" / f"{path.stem}-{key}"
    try:
        if not (entry / kind / marker).is_file():
            _drop_stale_derivations(entry.parent)
            entry.mkdir(parents=True, exist_ok=True)
            written = entry / f".source-{os.getpid()}.json"  # renamed into place: never read half-written
            written.write_text(json.dumps(source))
            os.replace(written, entry / "source.json")
        return write_once(entry / kind, write, marker=marker)
    except OSError as exc:
        logger.warning("could not keep the %s of %s in the cache (%s); deriving it again", kind, path.name, exc)
        return None


def _drop_stale_derivations(root: Path) -> None:
    """Removes the cache entries of files that are gone or changed since, or derived by another
    transformers version (each entry names its file in ``source.json``), so that a file rewritten
    again and again leaves one entry, not one per version."""
    import transformers

    for entry in root.glob("*/source.json"):
        try:
            source = json.loads(entry.read_text())
            stat = os.stat(source["path"])
            stale = ((stat.st_size, stat.st_mtime_ns, transformers.__version__)
                     != (source["size"], source["mtime_ns"], source["transformers"]))
        except (OSError, ValueError, KeyError, TypeError):
            stale = True
        if stale:
            shutil.rmtree(entry.parent, ignore_errors=True)


def load_gguf_config(path: str | os.PathLike) -> PretrainedConfig:
    """The transformers config of a GGUF file (derived once, then read from the cache, see
    :func:`derived_once`); raises :class:`GGUFError` for what is not supported."""
    from transformers import AutoConfig

    path = Path(path)
    directory = derived_once(path, "config", lambda d: GGUFCheckpoint(path).hf_config().save_pretrained(d),
                             marker="config.json")
    if directory is None:
        return GGUFCheckpoint(path).hf_config()
    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    config.name_or_path = ""  # as derived: the cache directory is no name of the model
    return config


def iterate_gguf_weights(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(hf_name, tensor)`` for every tensor of a GGUF file, one dequantized tensor at a time.

    Where each tensor's data lies in the file is kept in the cache beside the derived config (see
    :func:`derived_once`), so that a later start maps the tensors without parsing the metadata."""
    path = Path(path)

    def write(directory: Path) -> None:
        (directory / "tensors.json").write_text(json.dumps(GGUFCheckpoint(path).tensor_index()))

    try:
        directory = derived_once(path, "tensors", write, marker="tensors.json")
        index = (GGUFCheckpoint(path).tensor_index() if directory is None
                 else json.loads((directory / "tensors.json").read_text()))
        yield from _weights_of_index(path, index)
    finally:
        _open_reader.cache_clear()  # the weights are the last reader of the file
