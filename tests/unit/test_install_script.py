"""scripts/install.sh chooses torch's build, installs flash-attn against it, and says what it did. It runs against a
stand-in `python` (PYTHON=...) that records every pip command and answers the torch and flash-attn probes from what
it "installed", and stand-ins for `nvidia-smi` and `uname` on PATH: nothing is installed."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

FAKE_PYTHON = """#!{python}
import json, os, sys
state, log = os.environ["FAKE_STATE"], os.environ["FAKE_LOG"]
args = sys.argv[1:]
flash = state + ".flash_attn"
if args[0] == "-c":  # a probe: torch's "<version> <cuda or cpu>", or flash-attn's version, of what is installed
    probed = flash if "flash_attn" in args[1] else state
    if not os.path.exists(probed):
        sys.exit(1)
    print(open(probed).read())
    sys.exit(0)
with open(log, "a") as f:
    f.write(json.dumps(args) + "\\n")
torch = [a for a in args if a.startswith("torch")]
if torch:
    if "--index-url" in args and os.environ.get("FAKE_CPU_INDEX") == "down":
        sys.exit(1)
    build = os.environ["FAKE_INDEX_BUILD" if "--index-url" in args else "FAKE_DEFAULT_BUILD"]
    version = torch[0][len("torch=="):] if torch[0].startswith("torch==") else "2.13.0"
    open(state, "w").write(version + build)
if "flash-attn" in args or any(a.endswith(".whl") for a in args):
    if not os.path.exists(state):  # its setup.py imports torch: "No module named 'torch'"
        sys.exit(1)
    if "flash-attn" in args and "--no-build-isolation" not in args:  # pip's isolated build has no torch either
        sys.exit(1)
    open(flash, "w").write("2.8.3")
"""


def _tool(folder: Path, name: str, text: str) -> None:
    path = folder / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run(tmp_path: Path, *, system="Linux", gpu=False, torch=None, cpu_index="up", default_build="+cpu cpu",
         extras="dev", flash_attn=None, fails=False, **env):  # fmt: skip
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(bin_dir, "python", FAKE_PYTHON.format(python=sys.executable))
    _tool(bin_dir, "uname", f"#!/bin/sh\necho {system}\n")
    if gpu:
        _tool(bin_dir, "nvidia-smi", "#!/bin/sh\nexit 0\n")
    state = tmp_path / "torch"
    if torch:
        state.write_text(torch)
    if flash_attn:
        (tmp_path / "torch.flash_attn").write_text(flash_attn)
    environ = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "PYTHON": str(bin_dir / "python"),
        "FAKE_STATE": str(state),
        "FAKE_LOG": str(tmp_path / "pip.log"),
        "FAKE_CPU_INDEX": cpu_index,
        "FAKE_INDEX_BUILD": "+cpu cpu",
        "FAKE_DEFAULT_BUILD": default_build,
        "HOME": str(tmp_path),
        **env,
    }
    done = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), extras], env=environ, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert (done.returncode != 0) == fails, done.stdout + done.stderr
    log = tmp_path / "pip.log"
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return calls, done.stdout + done.stderr


def _torch_calls(calls):
    return [c for c in calls if any(a.startswith("torch==") for a in c)]


def test_linux_without_a_gpu_takes_the_cpu_build_from_the_pytorch_cpu_index(tmp_path):
    calls, out = _run(tmp_path)
    assert _torch_calls(calls) == [["-m", "pip", "install", "--timeout", "20", "--retries", "1", "--index-url",
                                    CPU_INDEX, "torch==2.13.0"]]  # fmt: skip
    assert calls[-1] == ["-m", "pip", "install", "-e", ".[dev]"]
    assert f"installed torch 2.13.0+cpu, a CPU build (pip install --index-url {CPU_INDEX} torch==2.13.0)" in out
    assert "with torch 2.13.0+cpu, a CPU build" in out.splitlines()[-1]


@pytest.mark.parametrize("default_build", ["+cpu cpu", " 13.0"], ids=["cpu", "cuda"])
def test_unreachable_cpu_index_falls_back_to_the_default_index_and_says_what_it_got(tmp_path, default_build):
    calls, out = _run(tmp_path, cpu_index="down", default_build=default_build)
    torch_calls = _torch_calls(calls)
    assert len(torch_calls) == 2 and "--index-url" in torch_calls[0]
    assert torch_calls[1] == ["-m", "pip", "install", "torch==2.13.0"]
    assert "gave no torch: falling back to pip's default index" in out
    if default_build == "+cpu cpu":
        assert "installed torch 2.13.0+cpu, a CPU build (pip install torch==2.13.0)" in out and "warning" not in out
    else:
        assert "a CUDA 13.0 build" in out and "warning: a CUDA build without a GPU" in out


def test_installed_torch_is_kept_and_an_empty_argument_installs_no_extras(tmp_path):
    calls, out = _run(tmp_path, torch="2.11.0 13.0", extras="")
    assert _torch_calls(calls) == [] and "keeping the installed torch 2.11.0, a CUDA 13.0 build" in out
    assert calls == [["-m", "pip", "install", "-e", "."]] and "extras: none" in out


def test_a_gpu_machine_leaves_torch_to_the_default_index(tmp_path):
    calls, out = _run(tmp_path, gpu=True)
    assert _torch_calls(calls) == [] and "nvidia-smi found" in out


def test_macos_takes_torch_from_the_default_index(tmp_path):
    calls, out = _run(tmp_path, system="Darwin")
    assert _torch_calls(calls) == [["-m", "pip", "install", "torch==2.13.0"]]
    assert "no GPU on Darwin: installed torch 2.13.0+cpu, a CPU build" in out


def test_an_empty_cpu_index_is_never_tried(tmp_path):
    calls, out = _run(tmp_path, TORCH_CPU_INDEX="")
    assert _torch_calls(calls) == [["-m", "pip", "install", "torch==2.13.0"]]
    assert "TORCH_CPU_INDEX=) gave no torch" in out


def _flash_calls(calls):
    return [c for c in calls if "flash-attn" in c or any(a.endswith(".whl") for a in c)]


def test_gpu_extra_builds_flash_attn_against_the_installed_torch_without_build_isolation(tmp_path):
    """Dao-AILab/flash-attention#1920: in pip's isolated build environment its setup.py finds no torch."""
    calls, out = _run(tmp_path, gpu=True, extras="trl,deepspeed,gpu", default_build=" 12.8")
    torch_at = next(i for i, c in enumerate(calls) if "torch>=2.6" in c)
    flash_at = next(i for i, c in enumerate(calls) if "flash-attn" in c)
    assert torch_at < flash_at < len(calls) - 1
    assert calls[flash_at] == ["-m", "pip", "install", "flash-attn", "--no-build-isolation"]
    assert {"packaging", "ninja"} <= set(calls[flash_at - 1])  # its build requirements, before it
    assert calls[-1] == ["-m", "pip", "install", "-e", ".[trl,deepspeed,gpu]"]
    assert "installed torch 2.13.0, a CUDA 12.8 build from pip's default index" in out
    assert "installed flash-attn 2.8.3 against torch 2.13.0, a CUDA 12.8 build (pip install flash-attn" in out


def test_gpu_extra_keeps_an_installed_cuda_torch_and_flash_attn(tmp_path):
    calls, out = _run(tmp_path, gpu=True, extras="gpu", torch="2.11.0 13.0", flash_attn="2.8.3")
    assert calls == [["-m", "pip", "install", "-e", ".[gpu]"]]
    assert "keeping the installed flash-attn 2.8.3" in out


def test_gpu_extra_installs_a_given_flash_attn_wheel(tmp_path):
    wheel = "flash_attn-2.8.3+cu12torch2.11-cp312-cp312-linux_x86_64.whl"
    calls, out = _run(tmp_path, gpu=True, extras="gpu", torch="2.11.0 12.8", FLASH_ATTN_WHEEL=wheel)
    assert _flash_calls(calls) == [["-m", "pip", "install", wheel]]
    assert f"installed flash-attn 2.8.3 from FLASH_ATTN_WHEEL={wheel}" in out


@pytest.mark.parametrize("torch", [None, "2.13.0+cpu cpu"], ids=["no-torch", "cpu-torch"])
def test_gpu_extra_without_a_cuda_torch_stops_before_building(tmp_path, torch):
    calls, out = _run(tmp_path, extras="trl,gpu", torch=torch, fails=True)
    assert _flash_calls(calls) == [] and _torch_calls(calls) == [] and calls == []
    assert "error: the gpu extra needs a CUDA build of torch" in out
