"""scripts/install.sh chooses torch's build and says what it did. It runs against a stand-in `python` (PYTHON=...)
that records every pip command and answers the torch probe from what it "installed", and stand-ins for
`nvidia-smi` and `uname` on PATH: nothing is installed."""

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
if args[0] == "-c":  # the torch probe: "<version> <cuda or cpu>" of what is installed
    if not os.path.exists(state):
        sys.exit(1)
    print(open(state).read())
    sys.exit(0)
with open(log, "a") as f:
    f.write(json.dumps(args) + "\\n")
torch = [a for a in args if a.startswith("torch==")]
if torch:
    if "--index-url" in args and os.environ.get("FAKE_CPU_INDEX") == "down":
        sys.exit(1)
    build = os.environ["FAKE_INDEX_BUILD" if "--index-url" in args else "FAKE_DEFAULT_BUILD"]
    open(state, "w").write(torch[0][len("torch=="):] + build)
"""


def _tool(folder: Path, name: str, text: str) -> None:
    path = folder / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run(tmp_path: Path, *, system="Linux", gpu=False, torch=None, cpu_index="up", default_build="+cpu cpu",
         extras="dev", **env):  # fmt: skip
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(bin_dir, "python", FAKE_PYTHON.format(python=sys.executable))
    _tool(bin_dir, "uname", f"#!/bin/sh\necho {system}\n")
    if gpu:
        _tool(bin_dir, "nvidia-smi", "#!/bin/sh\nexit 0\n")
    state = tmp_path / "torch"
    if torch:
        state.write_text(torch)
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
    assert done.returncode == 0, done.stderr
    log = tmp_path / "pip.log"
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return calls, done.stdout


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
