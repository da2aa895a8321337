"""Random-weight checkpoints written locally, for tests and demos (no hub access).

Llama-shaped, Mistral-shaped with a sliding window on every layer
(``architecture="mistral"``), Gemma-3-shaped with sliding-window and
full-attention layers mixed (``architecture="gemma3"``, a hybrid model: vLLM's
hybrid KV cache manager gives it several KV cache groups), or Phi-3-shaped with
LongRoPE scaling (``architecture="phi3"``: short or long rope factors, which vLLM
picks from ``max_model_len``).

``ensure_model(preset)`` returns the directory of a Hugging Face checkpoint
(``config.json`` + ``model.safetensors``) that vLLM and transformers can load. The
weights are random but deterministic: the same preset always yields the same bytes'
worth of model (seeded ``torch`` initialisation). No tokenizer is written; serve it
with ``skip_tokenizer_init=True`` and token-id prompts.

Contract:
- A model directory is either complete (it holds the marker file written last) or
  absent: the checkpoint is written into a temporary sibling directory and renamed
  into place, so a crash never leaves a half-written model behind.
- ``ensure_model`` is idempotent: a complete directory is reused without loading
  torch. A concurrent writer that wins the rename race is accepted as-is.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

_MARKER = "kvoffload-model.json"


@dataclass(frozen=True)
class ModelPreset:
    """Shape of a random model. ``dtype`` is the checkpoint and config dtype;
    ``sliding_window`` is the attention window in tokens of every layer (mistral) or
    of the ``sliding_attention`` layers (gemma3, whose ``full_every`` th layer is
    full attention). Gemma-3-shaped weights get random norm scales as well: with
    the library's initialisation such a tiny model repeats one token, which would
    make comparisons of its outputs blind."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str = "float32"
    seed: int = 0
    architecture: str = "llama"  # "llama" | "mistral" | "gemma3" | "phi3"
    sliding_window: int | None = None
    full_every: int = 6  # gemma3: layers 6, 12, ... are full attention (5:1)
    original_max_position: int = 256  # phi3: LongRoPE's short-factor range


PRESETS: dict[str, ModelPreset] = {
    # ~0.56M parameters, ~2 MB: for tests.
    "tiny": ModelPreset(
        name="tiny",
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    # ~100M parameters (75M in the layers, 24.6M tied embedding), GQA 12/4, ~400 MB:
    # on 2 CPU cores prefill costs milliseconds per token, so recomputing a long chat
    # history dominates time to first token.
    "demo": ModelPreset(
        name="demo",
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
}


# The tiny shape as a Mistral-style model: every layer a 64-token sliding window.
PRESETS["tiny-swa"] = replace(
    PRESETS["tiny"], name="tiny-swa", architecture="mistral", sliding_window=64
)
# Gemma-3-style hybrid: five 64-token sliding-window layers to one full-attention layer.
PRESETS["tiny-gemma3"] = replace(
    PRESETS["tiny"],
    name="tiny-gemma3",
    architecture="gemma3",
    num_hidden_layers=6,
    sliding_window=64,
)
# The tiny shape as a Phi-3-style model with LongRoPE (128k-context Phi-3/3.5/4-mini
# style): vLLM uses the long factors when max_model_len exceeds 256.
PRESETS["tiny-longrope"] = replace(PRESETS["tiny"], name="tiny-longrope", architecture="phi3")
# The demo's size as a Gemma-3-style hybrid (10 window layers, 2 full).
PRESETS["demo-gemma3"] = replace(
    PRESETS["demo"], name="demo-gemma3", architecture="gemma3", sliding_window=512
)


def default_root() -> Path:
    """``$XDG_CACHE_HOME/kvoffload/models`` (``~/.cache/kvoffload/models`` by default)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvoffload" / "models"


def model_dir(preset: str, root: Path | None = None) -> Path:
    """Where ``preset`` lives under ``root`` (default: ``default_root()``)."""
    return (root if root is not None else default_root()) / _preset(preset).name


def is_complete(path: Path, preset: ModelPreset) -> bool:
    """True when ``path`` holds a finished checkpoint of exactly ``preset``."""
    marker = path / _MARKER
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return bool(recorded == asdict(preset))


def ensure_model(preset: str, root: Path | None = None) -> Path:
    """Return the directory of ``preset``'s checkpoint, writing it first if needed.

    Raises ``ValueError`` for an unknown preset (naming the accepted ones). A stale or
    incomplete directory at the target path (no marker, or a marker for another
    shape) is replaced.
    """
    spec = _preset(preset)
    target = model_dir(preset, root)
    if is_complete(target, spec):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=target.parent))
    try:
        _write(spec, tmp)
        if target.exists():
            if is_complete(target, spec):  # another process finished first
                return target
            shutil.rmtree(target)
        try:
            tmp.rename(target)
        except OSError:
            if not is_complete(target, spec):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"preset: unknown {name!r}; accepted: {sorted(PRESETS)}") from None


def _architecture_args(spec: ModelPreset) -> dict[str, object]:
    """The config arguments that set the architecture apart."""
    if spec.architecture == "phi3":
        half = spec.hidden_size // spec.num_attention_heads // 2
        return {
            "initializer_range": 0.2,  # peaked logits: the factors change the tokens
            "original_max_position_embeddings": spec.original_max_position,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0] * half,
                "long_factor": [2.0**i for i in range(half)],
                "original_max_position_embeddings": spec.original_max_position,
            },
        }
    if spec.architecture != "gemma3":
        return {} if spec.sliding_window is None else {"sliding_window": spec.sliding_window}
    layer_types = [
        "full_attention" if (i + 1) % spec.full_every == 0 else "sliding_attention"
        for i in range(spec.num_hidden_layers)
    ]
    return {
        "sliding_window": spec.sliding_window,
        "layer_types": layer_types,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "initializer_range": 0.1,
    }


def _write(spec: ModelPreset, path: Path) -> None:
    """Build the seeded random model and save it into ``path`` (marker last)."""
    import torch
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
    )

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
        "phi3": (Phi3Config, Phi3ForCausalLM),
    }[spec.architecture]
    config = config_cls(
        **_architecture_args(spec),
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype=spec.dtype,
    )
    dtype = getattr(torch, spec.dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = model_cls(config).to(dtype)  # type: ignore[no-untyped-call]
        if spec.architecture == "gemma3":
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "norm" in name:
                        param.normal_(0.0, 1.0)
    model.config.dtype = spec.dtype
    model.save_pretrained(path)
    (path / _MARKER).write_text(json.dumps(asdict(spec), indent=2, sort_keys=True))


def parameter_count(preset: str) -> int:
    """Parameters of ``preset`` computed from its shape (no torch needed)."""
    s = _preset(preset)
    head_dim = s.hidden_size // s.num_attention_heads
    attn = 2 * s.hidden_size * s.hidden_size + 2 * s.hidden_size * s.num_key_value_heads * head_dim
    mlp = 3 * s.hidden_size * s.intermediate_size
    per_layer = attn + mlp + 2 * s.hidden_size
    embed = s.vocab_size * s.hidden_size * (1 if s.tie_word_embeddings else 2)
    return s.num_hidden_layers * per_layer + embed + s.hidden_size


def kv_bytes_per_token(preset: str) -> int:
    """Engine KV-cache bytes one token of ``preset`` occupies (K and V, every layer)."""
    s = _preset(preset)
    head_dim = s.hidden_size // s.num_attention_heads
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[s.dtype]
    return s.num_hidden_layers * 2 * s.num_key_value_heads * head_dim * itemsize
