"""CPU stand-ins for what a GPU node gives a launched job, for tests/dist/test_launch.py (imported by every Python
process whose PYTHONPATH starts with this folder; acts only in the ranks torchrun starts, and only when the test
sets HF_LONGCTX_CPU_LAUNCH=1), so that the documented launch lines run unchanged on CPU processes:

- mixed precision "no": the YAMLs say bf16, which CPU autocast runs too, but exactness against the run without SP
  is measured in float32 (ACCELERATE_MIXED_PRECISION is what `accelerate launch` exports from the YAML);
- DDP and FSDP on gloo: `use_cpu` (ACCELERATE_USE_CPU), without which accelerate sees one process per rank;
- FSDP: accelerate takes its FSDP route only for GPU-like distributed types; an `AcceleratorState` built with an
  FSDP plugin on MULTI_CPU is switched to FSDP, as on GPUs (tests/dist/_trainer_utils.accelerate_fsdp_on_cpu);
- DeepSpeed reads no backend from the environment on CPU (its CPU accelerator would pick oneCCL): the test passes
  the recipe `--ddp_backend gloo`, which DeepSpeed's process group then uses.

With HF_LONGCTX_LAUNCH_RECORD set to a folder, every rank also writes what it is there (`_launch_record`).
"""

import os

if os.environ.get("HF_LONGCTX_CPU_LAUNCH") == "1" and "LOCAL_RANK" in os.environ:
    os.environ["ACCELERATE_MIXED_PRECISION"] = "no"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") != "true":
        os.environ["ACCELERATE_USE_CPU"] = "true"
    if os.environ.get("ACCELERATE_USE_FSDP") == "true":
        from accelerate import state
        from accelerate.utils import DistributedType

        _init = state.AcceleratorState.__init__

        def _fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
            _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
            # Every later `AcceleratorState()` copies the process-level type (MULTI_CPU) again: keep FSDP.
            plugin = fsdp_plugin or self.__dict__.get("fsdp_plugin")
            if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
                self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, plugin

        state.AcceleratorState.__init__ = _fsdp_on_cpu

    _records = os.environ.get("HF_LONGCTX_LAUNCH_RECORD")
    if _records:
        import _launch_record

        # The rank records itself, not the Python processes it starts (they inherit its environment).
        del os.environ["HF_LONGCTX_LAUNCH_RECORD"]
        _launch_record.record_start(_records)
        _launch_record.record_groups(_records)
