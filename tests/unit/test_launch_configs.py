"""The accelerate configs and recipes the README documents can start together.

transformers' Trainer refuses `gradient_checkpointing=True` together with FSDP's own activation
checkpointing ("The activation_checkpointing in FSDP config and the gradient_checkpointing in training arg
can't be set to True simultaneously"); every recipe is documented with every FSDP config, so no FSDP config
may turn on `fsdp_activation_checkpointing` while a recipe turns on `gradient_checkpointing`.
"""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _load(folder: str) -> dict[str, dict]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted((ROOT / folder).glob("*.yaml"))}


def test_fsdp_configs_leave_activation_checkpointing_to_the_recipes():
    configs, recipes = _load("configs"), _load("recipes")
    # transformers 5.24 renamed gradient_checkpointing to activation_checkpointing (the old name still works).
    checkpointing = [
        name for name, r in recipes.items() if r.get("gradient_checkpointing") or r.get("activation_checkpointing")
    ]
    fsdp = {name: c for name, c in configs.items() if c.get("distributed_type") == "FSDP"}
    assert fsdp, "no FSDP config found"
    assert checkpointing, "no recipe uses gradient_checkpointing"
    for name, config in fsdp.items():
        assert not config["fsdp_config"].get("fsdp_activation_checkpointing"), (name, checkpointing)


def test_every_config_and_recipe_parses():
    for name, data in {**_load("configs"), **_load("recipes")}.items():
        assert isinstance(data, dict) and data, name


def test_multi_node_configs_launch_one_job_over_the_nodes():
    """A multi-machine DeepSpeed config must make accelerate start torchrun on every node (one job of
    num_processes ranks): its default, DeepSpeed's pdsh launcher without a hostfile, trains each node alone."""
    import socket

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_multi_gpu_env

    with socket.socket() as free:  # node 0 checks that its rendezvous port is free: give it one that is
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    multi = {name: c for name, c in _load("configs").items() if c.get("num_machines", 1) > 1}
    assert multi, "no multi-node config found"
    for name in multi:
        for node in (0, 1):
            argv = ["--config_file", str(ROOT / "configs" / name), "--machine_rank", str(node)]
            argv += ["--main_process_port", port]
            args = launch_command_parser().parse_args([*argv, "--main_process_ip", "10.0.0.1", "train.py"])
            args, *_ = _validate_launch_command(args)
            if args.use_deepspeed:
                assert args.deepspeed_multinode_launcher == "standard", name
            prepare_multi_gpu_env(args)  # the torchrun arguments of this node
            assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", node, "8"), name
            rendezvous = getattr(args, "master_addr", None) or getattr(args, "rdzv_endpoint", "")
            assert rendezvous.startswith("10.0.0.1"), name  # every node joins node 0
