#!/usr/bin/env python
"""Compile-check every CUDA source under bmt_wrap/kernels for sm_90.

Each ``.cu`` (and each ``.cuh`` on its own) goes through ``nvcc --ptx -arch=sm_90`` with warnings as
errors; when CuPy imports, each ``.cu`` is also compiled by NVRTC exactly as CuPy will compile it at
run time (headers inlined). Exits non-zero on any failure. Needs no GPU.

``--require-nvrtc`` (CI: ``make check-cuda`` installs CuPy and NVRTC, which need no GPU either) makes a
missing NVRTC a failure instead of a skip.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

KERNEL_DIR = Path(__file__).resolve().parents[1] / "bmt_wrap" / "kernels"
ARCH = "sm_90"


def nvcc_check(nvcc: str, source: Path, workdir: Path) -> str | None:
    """Compile one source (a header through a one-line stub) to PTX; return the error text, if any."""
    target = source
    if source.suffix == ".cuh":
        target = workdir / f"{source.stem}_header_check.cu"
        target.write_text(f'#include "{source}"\n')
    cmd = [nvcc, "--ptx", f"-arch={ARCH}", "--std=c++17", "--Werror", "all-warnings", "-I", str(KERNEL_DIR),
           "-o", str(workdir / f"{source.name}.ptx"), str(target)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    return None if done.returncode == 0 else f"{' '.join(cmd)}\n{done.stdout}{done.stderr}"


def _sources_module() -> ModuleType:
    # By path: importing the bmt_wrap package would import torch, which this check does not need.
    spec = importlib.util.spec_from_file_location("bmt_kernel_source", KERNEL_DIR / "source.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nvrtc_check(source: Path) -> str | None:
    """Compile one ``.cu`` with NVRTC (through CuPy), as the runtime does; return the error text, if any."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(_sources_module().kernel_source(source.name), source.name, [], [])
    try:
        nvrtc.compileProgram(prog, [f"--gpu-architecture=compute_{ARCH[3:]}", "--std=c++17"])
    except nvrtc.NVRTCError as exc:
        return f"NVRTC {source.name}: {exc}\n{nvrtc.getProgramLog(prog)}"
    finally:
        nvrtc.destroyProgram(prog)
    return None


def main() -> int:
    """Run every check, report each, and return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--require-nvrtc", action="store_true", help="fail when CuPy's NVRTC cannot load")
    args = parser.parse_args()
    sources = sorted(KERNEL_DIR.glob("*.cu")) + sorted(KERNEL_DIR.glob("*.cuh"))
    if not sources:
        print(f"no CUDA sources under {KERNEL_DIR}", file=sys.stderr)
        return 1
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("nvcc not found on PATH: install the CUDA toolkit (CI image has it) to compile-check the kernels",
              file=sys.stderr)
        return 1
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor() as pool:
        for source, error in zip(sources, pool.map(lambda s: nvcc_check(nvcc, s, Path(tmp)), sources), strict=True):
            print(f"nvcc {ARCH}  {source.name}: {'FAILED' if error else 'ok'}")
            if error:
                failures.append(error)
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()  # loads the NVRTC library itself
    except Exception as exc:  # no CuPy, or one that cannot load NVRTC here
        print(f"NVRTC check skipped: CuPy's NVRTC is not importable ({type(exc).__name__}: {exc})")
        if args.require_nvrtc:
            failures.append("--require-nvrtc: install cupy-cuda13x and nvidia-cuda-nvrtc (make check-cuda)")
    else:
        for source in sources:
            if source.suffix == ".cu":
                error = nvrtc_check(source)
                print(f"nvrtc {ARCH} {source.name}: {'FAILED' if error else 'ok'}")
                if error:
                    failures.append(error)
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
