"""The shape numbers of a decoder-only causal LM that its training memory depends on.

`load_model_shape(name_or_path)` is the main entry: a local `config.json`, a model folder holding
one, a name shipped in `hf_longctx/data/model_configs` (`llama3.1-8b`, `qwen3-4b`), or a Hub model id
(`Qwen/Qwen3-8B`: the Hugging Face cache, else the Hub). Only the config is read (no weights);
`ModelShape.from_config` maps the usual transformers config keys, including nested `text_config` and
the common MoE names.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

SHIPPED_DIR = "model_configs"

# MoE field names across transformers configs: (experts, experts per token, expert intermediate size).
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_TOPK_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk")
_EXPERT_INTERMEDIATE_KEYS = ("moe_intermediate_size", "expert_intermediate_size")


# Vision-language models hf_longctx leaves to transformers at sp_size=1 (`multimodal/vision.py::vision_refusal`,
# which the planner cannot import: it imports no torch); every other VLM is served at every SP size.
_OWN_ATTENTION_VLMS = dict.fromkeys(
    ("gemma3", "molmo2"), "a vision-language model whose decoder attends both ways within an image"
)


@dataclass(frozen=True)
class VisionShape:
    """The sizes of a vision tower that set its activation memory."""

    depth: int
    hidden: int
    intermediate: int
    out_hidden: int
    merge: int = 1  # patches merged into one feature (spatial_merge_size ** 2)
    deepstack: int = 0  # extra feature maps gathered with the output (Qwen3-VL)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionShape:
        """Read a VLM `config.json` dict's `vision_config` (Qwen-VL `depth` or CLIP-style `num_hidden_layers`).

        Raises:
            ValueError: no vision config, or one without its depth and width.
        """
        vision = config.get("vision_config")
        depth = vision and (vision.get("depth") or vision.get("num_hidden_layers"))
        if not vision or not depth or "hidden_size" not in vision:
            raise ValueError("vision_tower_bytes needs a config.json with a vision_config (depth and hidden_size).")
        hidden = int(vision["hidden_size"])
        return cls(
            depth=int(depth),
            hidden=hidden,
            intermediate=int(vision.get("intermediate_size") or 4 * hidden),
            out_hidden=int(vision.get("out_hidden_size") or config.get("text_config", {}).get("hidden_size") or hidden),
            merge=int(vision.get("spatial_merge_size") or 1) ** 2,
            deepstack=len(vision.get("deepstack_visual_indexes") or ()),
        )


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder: what parameters, activations and logits scale with.

    MoE layers count every expert as a parameter and `experts_per_token` experts (plus any shared
    expert) as activations; routing imbalance is not modelled. `own_attention` says why hf_longctx leaves this
    model's attention to transformers at `sp_size=1` (vision-language and linear-attention models,
    integrations/trainer/single.py), where transformers builds its own mask. `layer_types` names each decoder
    layer's attention ("full_attention", "sliding_attention" with `sliding_window`, "chunked_attention" with
    `attention_chunk`); empty means every layer is full.
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    own_attention: str = ""  # why hf_longctx leaves attention to transformers without SP ("": it serves it)
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    attention_chunk: int = 0
    model_type: str = ""  # the config's `model_type`: which of hf_longctx's per-family features apply
    vision: VisionShape | None = None  # a VLM's vision tower (`--vision-patches`)

    def __post_init__(self) -> None:
        for key in ("hidden", "layers", "heads", "kv_heads", "head_dim", "vocab"):
            if getattr(self, key) < 1:
                raise ValueError(f"model {self.name!r}: {key} must be >= 1, got {getattr(self, key)}.")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model {self.name!r}: num_attention_heads ({self.heads}) must be a multiple of "
                f"num_key_value_heads ({self.kv_heads})."
            )
        if self.layer_types and len(self.layer_types) != self.layers:
            raise ValueError(f"model {self.name!r}: {len(self.layer_types)} layer_types for {self.layers} layers.")
        for kind, size, key in (("sliding_attention", self.sliding_window, "sliding_window"),
                                ("chunked_attention", self.attention_chunk, "attention_chunk")):  # fmt: skip
            if kind in self.layer_types and size < 1:
                raise ValueError(f"model {self.name!r}: {kind} layers need {key} >= 1, got {size}.")

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str = "model") -> ModelShape:
        """Read a transformers `config.json` dict (a multimodal one through its `text_config`).

        Raises:
            ValueError: a required size is missing.
        """
        own = _OWN_ATTENTION_VLMS.get(str(config.get("model_type", "")), "") if "vision_config" in config else ""
        vision = _vision_shape(config)
        config = config.get("text_config") or config
        if any(isinstance(t, str) and "linear" in t for t in config.get("layer_types") or ()):
            own = own or "it has linear-attention layers"
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [k for k in required if k not in config]
        if missing:
            raise ValueError(f"config of {name!r} lacks {missing}; pass a decoder LM's config.json.")
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        experts = _first(config, _EXPERT_KEYS, 0)
        dense_intermediate = int(config.get("intermediate_size") or 4 * hidden)
        shared = int(config.get("shared_expert_intermediate_size") or 0)
        expert_intermediate = _first(config, _EXPERT_INTERMEDIATE_KEYS, dense_intermediate if experts else 0)
        if experts and not shared and config.get("n_shared_experts"):
            shared = int(config["n_shared_experts"]) * expert_intermediate
        return cls(
            name=name,
            hidden=hidden,
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate=dense_intermediate,
            vocab=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            qk_norm=config.get("model_type", "") in ("qwen3", "qwen3_moe", "olmo2", "olmo3", "gemma3_text"),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            experts=experts,
            experts_per_token=_first(config, _TOPK_KEYS, 0) if experts else 0,
            expert_intermediate=expert_intermediate if experts else 0,
            shared_intermediate=shared,
            own_attention=own,
            model_type=str(config.get("model_type", "")),
            vision=vision,
            **_attention_layers(config, int(config["num_hidden_layers"])),
        )

    def layer_kinds(self) -> dict[str, int]:
        """Decoder layers per attention kind, in order of first appearance (`{"full_attention": layers}` if none)."""
        kinds: dict[str, int] = {}
        for kind in self.layer_types or ("full_attention",) * self.layers:
            kinds[kind] = kinds.get(kind, 0) + 1
        return kinds

    @property
    def mlp_width(self) -> int:
        """Intermediate width one token activates (dense, or top-k experts plus shared experts)."""
        if self.experts:
            return self.experts_per_token * self.expert_intermediate + self.shared_intermediate
        return self.intermediate

    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention, MLP or experts and router, norms)."""
        h, d = self.hidden, self.head_dim
        q, kv = self.heads * d, self.kv_heads * d
        attn = h * (q + 2 * kv) + q * h
        if self.attention_bias:
            attn += q + 2 * kv + h
        if self.qk_norm:
            attn += 2 * d
        if self.experts:
            mlp = self.experts * 3 * h * self.expert_intermediate + 3 * h * self.shared_intermediate + h * self.experts
        else:
            mlp = 3 * h * self.intermediate + (2 * self.intermediate + h if self.mlp_bias else 0)
        return attn + mlp + 2 * h

    def embedding_params(self) -> int:
        """Input embedding plus LM head (one matrix when tied) plus the final norm."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    def num_params(self) -> int:
        """All parameters of the causal LM."""
        return self.layers * self.layer_params() + self.embedding_params()


# Full-attention layer every n-th layer when a config.json has a window but no `layer_types` (transformers' rule).
_WINDOW_PATTERNS = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6}


def _attention_layers(config: dict[str, Any], layers: int) -> dict[str, Any]:
    """`layer_types`, `sliding_window` and `attention_chunk` as transformers derives them from a config.json:
    `layer_types` when given; else chunked layers where Llama 4's `no_rope_layers` is set (every layer but each
    fourth by default); else, with a `sliding_window`: every `sliding_window_pattern`-th layer full, the others
    windowed (Gemma 3: 6 by default, Gemma 2: 2); Qwen2-style configs (`use_sliding_window`) window the layers
    from `max_window_layers` on; the others (Mistral) every layer."""
    window = int(config.get("sliding_window") or 0)
    chunk = int(config.get("attention_chunk_size") or 0)
    types = config.get("layer_types")
    pattern = config.get("sliding_window_pattern") or _WINDOW_PATTERNS.get(config.get("model_type", ""), 0)
    if types:
        kinds = tuple(types)
    elif window and pattern:
        kinds = tuple("sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(layers))
    elif chunk:
        no_rope = config.get("no_rope_layers") or [int((i + 1) % 4 != 0) for i in range(layers)]
        kinds = tuple("chunked_attention" if flag else "full_attention" for flag in no_rope)
    elif window and "use_sliding_window" in config:
        first = int(config.get("max_window_layers", 0)) if config["use_sliding_window"] else layers
        kinds = tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers))
    else:
        kinds = ("sliding_attention",) * layers if window else ()
    if set(kinds) <= {"full_attention"}:
        return {}
    return {"layer_types": kinds, "sliding_window": window, "attention_chunk": chunk}


def _first(config: dict[str, Any], keys: tuple[str, ...], default: int) -> int:
    for key in keys:
        if config.get(key):
            return int(config[key])
    return default


def shipped_model_names() -> list[str]:
    """Names `load_model_shape` accepts without a path (configs shipped in the package)."""
    folder = files("hf_longctx") / "data" / SHIPPED_DIR
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def load_model_shape(name_or_path: str) -> ModelShape:
    """The `ModelShape` of a `config.json` file, a folder holding one, a shipped name, or a Hub model id.

    A Hub id's config.json comes from the Hugging Face cache first (no network), else from the Hub unless
    `HF_HUB_OFFLINE` is set; `HF_HOME` / `HF_HUB_CACHE` / `HF_TOKEN` apply as in transformers.

    Raises:
        ValueError: none of these has a config.json (the message names each place tried and the fix).
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return ModelShape.from_config(json.loads(path.read_text()), name=str(name_or_path))
    key = name_or_path.lower()
    if key in shipped_model_names():
        text = (files("hf_longctx") / "data" / SHIPPED_DIR / f"{key}.json").read_text()
        return ModelShape.from_config(json.loads(text), name=key)
    found, tried = _hub_config(name_or_path)
    if found is not None:
        return ModelShape.from_config(json.loads(found.read_text()), name=name_or_path)
    # A Hub id of a model shipped under a short name (Qwen/Qwen3-8B: qwen3-8b) can be planned from that.
    same = [n for n in shipped_model_names() if _bare(n) == _bare(key.rsplit("/", 1)[-1])]
    shipped = f"--model {same[0]} (shipped) or " if same else ""
    raise ValueError(
        f"--model {name_or_path!r}: no config.json found. Tried: a local path ({path}: no such file); the shipped "
        f"names {shipped_model_names()}; {'; '.join(tried)}. Fix: {shipped}pass the path of the model's config.json "
        "(or of a folder holding one), e.g. downloaded from the model's Hub page."
    )


def _bare(name: str) -> str:
    """A model name without its maker's prefix and punctuation: Meta-Llama-3.1-8B and llama3.1-8b are one."""
    return re.sub(r"[^a-z0-9]", "", name.lower().removeprefix("meta-"))


def _hub_config(repo_id: str) -> tuple[Path | None, list[str]]:
    """A Hub model id's config.json from the cache, else from the Hub (config.json only), and what was tried.

    huggingface_hub is imported here, not at the top: only Hub ids need it, and it takes longer to import than
    the rest of the planner (it imports no torch or transformers either way).
    """
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, HFValidationError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None, ["not a Hub model id (Org/Name), so neither the Hugging Face cache nor the Hub"]
    cached = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):  # else None, or a marker that the Hub has no such file
        return Path(cached), []
    folder = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    tried = [f"the Hugging Face cache ({folder}: no snapshots/<refs/main>/config.json)"]
    if constants.HF_HUB_OFFLINE:
        return None, [*tried, "the Hub: not tried, HF_HUB_OFFLINE is set"]
    try:
        return Path(hf_hub_download(repo_id, "config.json")), tried
    except GatedRepoError:
        reason = "a gated model: accept its terms on the Hub and log in (`hf auth login` or HF_TOKEN)"
    except RepositoryNotFoundError:
        reason = "no such model, or a private one without a token (HF_TOKEN)"
    except (OSError, EntryNotFoundError) as exc:  # unreachable (LocalEntryNotFoundError), no config.json, HTTP
        reason = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    return None, [*tried, f"the Hub ({constants.ENDPOINT}: {reason})"]


def _vision_shape(config: dict[str, Any]) -> VisionShape | None:
    """The vision tower's sizes where the config gives them (only `--vision-patches` needs them)."""
    try:
        return VisionShape.from_config(config)
    except ValueError:
        return None


def ceil_div(a: int, b: int) -> int:
    """Integer ceiling of a / b."""
    return -(-a // b)
