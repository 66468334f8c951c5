"""`hf-longctx plan`'s model: per-rank peak memory of one training step and the longest sequence that fits.

`estimate.py` is the main entry (`estimate`, `max_seq_len`, the verdict with `PLAN_ERROR` as headroom), `run.py`
the run's settings, `terms.py` the per-layer and loss activation terms (`tiled.py` for `tiled_layer`), `search.py`
the cheapest configuration that fits, `settings.py` the real settings (TrainingArguments, ParallelismConfig,
launch config) a run maps to, `devices.py` the device profiles, `model_shape.py` the shape numbers read from a
model config, `vision.py` a VLM's vision tower per rank (sharded over SP or not). The planner imports no torch,
so `hf-longctx plan` answers in well under a second.
"""

from hf_longctx.planner.devices import DEVICES, DeviceProfile
from hf_longctx.planner.estimate import GIB, PLAN_ERROR, TERMS, Plan, estimate, max_seq_len, model_state_bytes
from hf_longctx.planner.model_shape import ModelShape, load_model_shape, shipped_model_names
from hf_longctx.planner.run import ATTNS, DTYPES, ENGINES, SP_BACKENDS, UNMODELLED_BACKENDS, RunConfig
from hf_longctx.planner.search import SearchResult, Suggestion, search
from hf_longctx.planner.settings import LAUNCH_CONFIGS, Settings, settings_for
from hf_longctx.planner.terms import layer_bytes, loss_bytes, norm_bytes
from hf_longctx.planner.tiled import tiled_layer_bytes
from hf_longctx.planner.vision import VisionShape, vision_tower_bytes

__all__ = [
    "ATTNS",
    "DEVICES",
    "DTYPES",
    "ENGINES",
    "GIB",
    "LAUNCH_CONFIGS",
    "PLAN_ERROR",
    "TERMS",
    "DeviceProfile",
    "ModelShape",
    "Plan",
    "RunConfig",
    "SP_BACKENDS",
    "SearchResult",
    "Settings",
    "Suggestion",
    "UNMODELLED_BACKENDS",
    "VisionShape",
    "estimate",
    "layer_bytes",
    "load_model_shape",
    "loss_bytes",
    "max_seq_len",
    "model_state_bytes",
    "norm_bytes",
    "search",
    "settings_for",
    "shipped_model_names",
    "tiled_layer_bytes",
    "vision_tower_bytes",
]
