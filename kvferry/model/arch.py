"""Architecture table and the model's shape config.

The differences between supported architectures are data (`ArchSpec`), so adding a
llama-like architecture is one table entry, not new model code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvferry import KvferryError


@dataclass(frozen=True)
class ArchSpec:
    qkv_bias: bool = False  # q/k/v projections carry a bias (qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (qwen3)
    # llama.cpp's converter permutes q/k rows of llama-family GGUFs for its interleaved
    # RoPE; we use the half-split (NeoX) rotation everywhere and undo the permutation.
    gguf_permuted_qk: bool = False


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec(gguf_permuted_qk=True),
    "mistral": ArchSpec(gguf_permuted_qk=True),
    "qwen2": ArchSpec(qkv_bias=True),
    "qwen3": ArchSpec(qk_norm=True),
}


def arch_spec(name: str) -> ArchSpec:
    try:
        return ARCHS[name]
    except KeyError:
        raise KvferryError(
            f"unsupported architecture '{name}' (supported: {', '.join(sorted(ARCHS))})"
        ) from None


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict ({"rope_type": "llama3", "factor": ...}) or None
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    max_position: int = 4096
    tie_embeddings: bool = False
    name: str = ""

    def __post_init__(self):
        arch_spec(self.arch)
        if self.num_heads % self.num_kv_heads:
            raise KvferryError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def spec(self) -> ArchSpec:
        return ARCHS[self.arch]

    @property
    def num_params(self) -> int:
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        layer = attn + 3 * h * f + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + emb + h

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelConfig":
        """Build from a Hugging Face config.json dict."""
        model_type = cfg.get("model_type", "")
        arch_spec(model_type)
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        return cls(
            arch=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            rope_scaling=_rope_scaling(cfg),
            max_position=cfg.get("max_position_embeddings", 4096),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            name=cfg.get("_name_or_path", "") or model_type,
        )


def load_hf_config(path: str) -> ModelConfig:
    """A Hugging Face config.json as a ModelConfig. A file that is missing, unreadable, not
    JSON or short of a field the model needs is a KvferryError that names the file."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise KvferryError(f"{path}: no such file") from None
    except OSError as e:
        raise KvferryError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise KvferryError(f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
    except json.JSONDecodeError as e:
        raise KvferryError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    if not isinstance(raw, dict):
        raise KvferryError(f"{path} holds a JSON {type(raw).__name__}, not an object of model settings")
    try:
        return ModelConfig.from_hf_config(raw)
    except KeyError as e:
        raise KvferryError(f"{path} lacks '{e.args[0]}', which the model's shape needs") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise KvferryError(f"{path} has a setting of the wrong type or value: {e}") from None
    except KvferryError as e:
        raise KvferryError(f"{path}: {e}") from None


def _rope_theta(cfg: dict) -> float:
    if "rope_theta" in cfg:
        return float(cfg["rope_theta"])
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def _rope_scaling(cfg: dict) -> dict | None:
    # transformers 4.x writes rope_scaling; 5.x writes rope_parameters (theta included)
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    rtype = rs.get("rope_type") or rs.get("type") or "default"
    if rtype == "default":
        return None
    return dict(rs, rope_type=rtype)


# Presets of real model shapes, for random-weight speed runs.
PRESETS: dict[str, dict] = {
    "llama3-8b": dict(arch="llama", vocab_size=128256, hidden_size=4096, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
                      rms_eps=1e-5, rope_theta=500000.0, max_position=131072),
    "llama3-70b": dict(arch="llama", vocab_size=128256, hidden_size=8192, num_layers=80,
                       num_heads=64, num_kv_heads=8, head_dim=128, intermediate_size=28672,
                       rms_eps=1e-5, rope_theta=500000.0, max_position=131072),
    "qwen3-32b": dict(arch="qwen3", vocab_size=151936, hidden_size=5120, num_layers=64,
                      num_heads=64, num_kv_heads=8, head_dim=128, intermediate_size=25600,
                      rms_eps=1e-6, rope_theta=1000000.0, max_position=40960),
    "smollm2-135m": dict(arch="llama", vocab_size=49152, hidden_size=576, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
                         rms_eps=1e-5, rope_theta=100000.0, max_position=8192,
                         tie_embeddings=True),
}


def preset_config(name: str, num_layers: int | None = None) -> ModelConfig:
    if name not in PRESETS:
        raise KvferryError(f"unknown preset '{name}' (known: {', '.join(PRESETS)})")
    kw = dict(PRESETS[name], name=f"{name} (random)")
    if num_layers:
        kw["num_layers"] = num_layers
    return ModelConfig(**kw)
