"""`hf-longctx plan`'s model: per-rank peak memory of one training step and the longest sequence that fits.

`estimate.py` is the main entry (`estimate`, `max_seq_len`), `run.py` the run's settings, `terms.py` the
per-layer and loss activation terms (`tiled.py` for `tiled_layer`), `advice.py` the next flag to turn on,
`devices.py` the device profiles, `model_shape.py` the shape numbers read from a model config. The planner
imports no torch, so `hf-longctx plan` answers in well under a second.
"""

from hf_longctx.planner.advice import Advice, next_flag
from hf_longctx.planner.devices import DEVICES, DeviceProfile
from hf_longctx.planner.estimate import GIB, TERMS, Plan, estimate, max_seq_len, model_state_bytes
from hf_longctx.planner.model_shape import ModelShape, load_model_shape, shipped_model_names
from hf_longctx.planner.run import ATTNS, DTYPES, ENGINES, SP_BACKENDS, UNMODELLED_BACKENDS, RunConfig
from hf_longctx.planner.terms import layer_bytes, loss_bytes, norm_bytes
from hf_longctx.planner.tiled import tiled_layer_bytes

__all__ = [
    "ATTNS",
    "Advice",
    "DEVICES",
    "DTYPES",
    "ENGINES",
    "GIB",
    "TERMS",
    "DeviceProfile",
    "ModelShape",
    "Plan",
    "RunConfig",
    "SP_BACKENDS",
    "UNMODELLED_BACKENDS",
    "estimate",
    "layer_bytes",
    "load_model_shape",
    "loss_bytes",
    "max_seq_len",
    "next_flag",
    "model_state_bytes",
    "norm_bytes",
    "shipped_model_names",
    "tiled_layer_bytes",
]
