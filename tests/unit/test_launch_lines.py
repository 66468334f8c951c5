"""Every launch line the project documents is a form that a test executes.

The lines: each `accelerate launch`, `torchrun` and `sbatch` line of README.md and docs/*.md (shell code blocks,
and inline code that names what it launches), of the recipes' headers (recipes/*.yaml comments, recipes/*.py
docstrings) and of the configs' comments (configs/*.yaml, configs/slurm_2nodes.sbatch). A GPU line cannot run here
at its size, so each must be a form tests/dist/test_launch.py runs on two "nodes" of 2 CPU processes:

- `accelerate launch`: flags among `--config_file` (required, a shipped configs/*.yaml), `--num_processes`,
  `--num_machines`, `--machine_rank`, `--main_process_ip`, `--main_process_port`; with `--machine_rank`, a
  multi-node config the test runs. Executed by test_launch's `deepspeed` (configs/2nodes_sp8.yaml) and `fsdp2`
  (configs/2nodes_fsdp2_sp8.yaml) cases.
- `torchrun`: flags among `--nnodes`, `--nproc_per_node`, `--rdzv_backend`, `--rdzv_endpoint`, `--rdzv_id`; with
  `--nnodes`, the c10d rendezvous (`--rdzv_backend c10d`, an endpoint and an id). Executed by the `torchrun` case.
- `sbatch configs/slurm_2nodes.sbatch`, optionally `CONFIG=` a 2-node config before it and recipe arguments after.
  Executed by the `slurm` case (the template's srun line, once per node).

and the script of each is a shipped recipes/*.py with a shipped `--config recipes/*.yaml`. Single-node lines are
the same forms with fewer flags (one node of the same launch). The one line outside these forms is the library
demo's, run as written by tests/dist/test_demo.py (`EXECUTED_ELSEWHERE`).
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
LAUNCHERS = ("accelerate launch", "torchrun", "sbatch")
ACCELERATE_FLAGS = {
    "--config_file",
    "--num_processes",
    "--num_machines",
    "--machine_rank",
    "--main_process_ip",
    "--main_process_port",
}
TORCHRUN_FLAGS = {"--nnodes", "--nproc_per_node", "--rdzv_backend", "--rdzv_endpoint", "--rdzv_id"}
MULTI_NODE_CONFIGS = {"configs/2nodes_sp8.yaml", "configs/2nodes_fsdp2_sp8.yaml"}  # test_launch's CASES
SBATCH_TEMPLATE = "configs/slurm_2nodes.sbatch"
EXECUTED_ELSEWHERE = {
    "torchrun --standalone --nproc_per_node 2 -m hf_longctx.cli.demo": "tests/dist/test_demo.py",
}
_START = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(?:accelerate launch|torchrun|sbatch)\s")
_NAMES_WHAT_IT_LAUNCHES = re.compile(r"\.py\b|\s-m\s|\.sbatch\b")  # not prose like "torchrun sets ..."


def _joined(lines: list[str]) -> list[str]:
    """Shell lines with their `\\` continuations joined and trailing `# comments` dropped."""
    out, pending = [], ""
    for line in lines:
        line = line.strip()
        if pending:
            line = pending + " " + line
        if line.endswith("\\"):
            pending = line[:-1].strip()
            continue
        pending = ""
        out.append(re.sub(r"\s+#.*$", "", line))
    return out


def _markdown_lines(text: str) -> list[str]:
    """Candidate lines: those of shell code blocks, and inline code spans."""
    found, block, lang = [], None, ""
    for line in text.splitlines():
        fence = re.match(r"^\s*```(\w*)", line)
        if fence:
            if block is None:
                block, lang = [], fence.group(1)
            else:
                found += _joined(block) if lang in ("bash", "sh", "shell", "") else []
                block = None
            continue
        if block is not None:
            block.append(line)
        else:
            found += re.findall(r"`([^`]+)`", line)
    return found


def _comment_lines(text: str) -> list[str]:
    """Launch lines in `#` comments (a YAML header, the sbatch template), `Run:` prefixes dropped."""
    comments = [re.sub(r"^#\s*(Run:\s*)?", "", line.strip()) for line in text.splitlines() if line.startswith("#")]
    return _joined(comments)


def _docstring_lines(text: str) -> list[str]:
    return _joined((ast.get_docstring(ast.parse(text)) or "").splitlines())


def documented_lines() -> list[tuple[str, str]]:
    """(file, line) for every launch line of the documentation, the recipes and the configs."""
    sources = [(p, _markdown_lines) for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]]
    sources += [(p, _comment_lines) for p in sorted((ROOT / "recipes").glob("*.yaml"))]
    sources += [(p, _docstring_lines) for p in sorted((ROOT / "recipes").glob("*.py"))]
    sources += [(p, _comment_lines) for p in [*sorted((ROOT / "configs").glob("*.yaml")), ROOT / SBATCH_TEMPLATE]]
    return [
        (str(path.relative_to(ROOT)), line)
        for path, extract in sources
        for line in extract(path.read_text())
        if _START.match(line + " ") and _NAMES_WHAT_IT_LAUNCHES.search(line + " ")
    ]


def _flags_and_script(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """Launcher flags (each with its value) up to the script, and the script with its arguments."""
    flags = {}
    while words and words[0].startswith("--"):
        flags[words[0]], words = words[1], words[2:]
    return flags, words


def _check_script(script: list[str]) -> None:
    assert script and re.fullmatch(r"recipes/\w+\.py", script[0]), f"not a shipped recipe script: {script[:1]}"
    assert (ROOT / script[0]).is_file(), script[0]
    assert script[1:2] == ["--config"] and (ROOT / script[2]).is_file(), f"no shipped recipe after {script[0]}"


def check_line(line: str) -> None:
    """Fail unless `line` is one of the forms in the module docstring."""
    if line in EXECUTED_ELSEWHERE:
        return
    words = shlex.split(line)
    env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S+", w))
    words = words[len(env) :]
    if words[0] == "sbatch":
        assert words[1] == SBATCH_TEMPLATE, line
        assert set(env) <= {"CONFIG"} and env.get("CONFIG", "configs/2nodes_fsdp2_sp8.yaml") in MULTI_NODE_CONFIGS
        return
    assert not env, f"environment before {words[0]}: {env}"
    if words[0] == "accelerate":
        flags, script = _flags_and_script(words[2:])
        assert set(flags) <= ACCELERATE_FLAGS, set(flags) - ACCELERATE_FLAGS
        config = flags.get("--config_file", "")
        assert re.fullmatch(r"configs/\w+\.yaml", config) and (ROOT / config).is_file(), f"no shipped config: {line}"
        if "--machine_rank" in flags:
            assert config in MULTI_NODE_CONFIGS and "--main_process_ip" in flags, line
    else:
        flags, script = _flags_and_script(words[1:])
        assert set(flags) <= TORCHRUN_FLAGS, set(flags) - TORCHRUN_FLAGS
        if "--nnodes" in flags:
            assert flags.get("--rdzv_backend") == "c10d" and {"--rdzv_endpoint", "--rdzv_id"} <= set(flags), line
    _check_script(script)


def test_the_documentation_has_launch_lines_of_every_form():
    lines = [line for _, line in documented_lines()]
    for form in ("accelerate launch", "torchrun --nnodes 2", "sbatch configs/slurm_2nodes.sbatch"):
        assert any(line.startswith(form) for line in lines), form
    assert any("--config_file configs/2nodes_fsdp2_sp8.yaml --machine_rank" in line for line in lines)


@pytest.mark.parametrize(("source", "line"), documented_lines(), ids=lambda v: v[:60])
def test_every_documented_launch_line_is_a_tested_form(source, line):
    check_line(line)


@pytest.mark.parametrize(
    "line",
    [
        "accelerate launch --num_processes 4 recipes/dpo.py --config recipes/qwen3_4b_dpo_32k_sp4.yaml",  # no YAML
        "accelerate launch --config_file configs/nope.yaml recipes/sft.py --config recipes/tiny_llama_4k_sp2.yaml",
        "accelerate launch --config_file configs/zero3_sp8.yaml --machine_rank 1 --main_process_ip h recipes/sft.py "
        "--config recipes/llama31_8b_512k_sp8.yaml",  # one node's YAML on two nodes
        "accelerate launch --config_file configs/cpu_sp2.yaml --multi_gpu recipes/sft.py --config "
        "recipes/tiny_llama_4k_sp2.yaml",  # an untested flag
        "torchrun --nnodes 2 --nproc_per_node 8 recipes/sft.py --config recipes/llama31_8b_512k_sp8.yaml",  # no c10d
        "torchrun --nproc_per_node 2 recipes/sft.py --config recipes/missing.yaml",
        "CONFIG=configs/zero3_sp8.yaml sbatch configs/slurm_2nodes.sbatch",
    ],
)
def test_a_line_outside_the_forms_is_refused(line):
    with pytest.raises(AssertionError):
        check_line(line)


def test_the_multi_node_configs_are_the_shipped_two_node_ones():
    shipped = {
        f"configs/{p.name}"
        for p in (ROOT / "configs").glob("*.yaml")
        if yaml.safe_load(p.read_text()).get("num_machines", 1) > 1
    }
    assert shipped == MULTI_NODE_CONFIGS


def test_node_0_has_one_name_everywhere():
    """`$MAIN_NODE_IP` (accelerate's `--main_process_ip`) in every line, the Slurm template and the planner's lines."""
    from hf_longctx.planner import RunConfig, settings_for

    multi_node = [line for _, line in documented_lines() if "--main_process_ip" in line or "--rdzv_endpoint" in line]
    assert multi_node
    for line in multi_node:
        words = shlex.split(line)
        flags = {word: words[i + 1] for i, word in enumerate(words[:-1]) if word.startswith("--")}
        node0 = flags.get("--main_process_ip") or flags["--rdzv_endpoint"].split(":")[0]
        assert node0 == "$MAIN_NODE_IP", line
    template = (ROOT / SBATCH_TEMPLATE).read_text()
    assert '--main_process_ip "$MAIN_NODE_IP"' in template and "MAIN_NODE_IP=$(scontrol show hostnames" in template
    flags = settings_for("llama3.1-8b", RunConfig(seq_len=8192, world=16, sp=8, engine="zero3")).launch_flags
    assert flags[flags.index("--main_process_ip") + 1] == "$MAIN_NODE_IP"
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "configs").iterdir()]:
        if path.is_file():
            assert not re.search(r"\$NODE0\b|\bHEAD_NODE\b|\bHEAD_PORT\b", path.read_text()), path
