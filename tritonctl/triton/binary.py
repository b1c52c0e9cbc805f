"""Find the tritonserver to run: the configured one, one on PATH, or the one in nvidia-pytriton.

The nvidia-pytriton wheel ships a real Triton (2.51, a GPU build that runs on CPUs too, Python backend only);
`tritonctl bundle` trims it into a folder of the same layout that travels to a host without the wheel.
Two details make it start: the Python backend stub for this interpreter's version must
sit next to libtriton_python.so (we assemble a backend folder of symlinks in the user's
cache rather than writing into site-packages), and LD_LIBRARY_PATH must include the
wheel's bundled libraries. The stub must also find this environment's packages (see
`_python_env`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tritonctl.errors import TritonctlError


@dataclass(frozen=True)
class TritonBinary:
    path: Path
    source: str  # "configured", "PATH" or "nvidia-pytriton"
    backend_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)

    def backends(self) -> set[str]:
        """The backends this tritonserver can load: its backend folder's subfolders (the assembled one's, else
        the install's `backends/` beside `bin/`)."""
        folder = self.backend_dir or self.path.resolve().parent.parent / "backends"
        return {p.name for p in folder.iterdir() if p.is_dir()} if folder.is_dir() else set()

    def gpu_backend(self) -> str:
        """What serves a GPU instance here: Triton's onnxruntime backend where this tritonserver has it, else the
        Python backend with tritonctl's PyTorch glue (the Triton in nvidia-pytriton has only that one)."""
        return "onnxruntime" if "onnxruntime" in self.backends() else "python"


def cache_dir() -> Path:
    """tritonctl's folder in the user's cache."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tritonctl"


def _python_env() -> dict[str, str]:
    """Let the Python backend stub import numpy and onnxruntime from this environment.

    The stub's embedded interpreter ignores PYTHONPATH; it finds its packages by locating
    `python3` on PATH (and that interpreter's pyvenv.cfg). Measured: with this
    interpreter's folder first on PATH the model loads, without it `No module named 'numpy'`.
    """
    return {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}


def _assemble(root: Path, libs: Path, source: str) -> TritonBinary:
    """The tritonserver of a folder laid out as nvidia-pytriton's (`root`/bin, backends, python_backend_stubs),
    its libraries in `libs`: the backend folder for this interpreter's stub, and the environment that finds both."""
    binary = root / "bin" / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise TritonctlError(f"the tritonserver in {root} has no Python backend stub for Python {version}")
    ld_path = os.pathsep.join(p for p in (str(libs), os.environ.get("LD_LIBRARY_PATH", "")) if p)
    ldd = subprocess.run(
        ["ldd", str(stub)], capture_output=True, text=True, env={**os.environ, "LD_LIBRARY_PATH": ld_path}
    )
    missing = [line.split()[0] for line in ldd.stdout.splitlines() if "not found" in line]
    if missing:
        raise TritonctlError(
            f"the Triton Python backend stub cannot find {', '.join(missing)}; "
            f"on Debian/Ubuntu: apt-get install libpython{version}"
        )
    backend_dir = cache_dir() / f"backends-{hashlib.sha256(str(root).encode()).hexdigest()[:8]}-py{version}"
    python = backend_dir / "python"
    python.mkdir(parents=True, exist_ok=True)
    for target in (
        root / "backends" / "python" / "libtriton_python.so",
        root / "backends" / "python" / "triton_python_backend_utils.py",
        stub,
    ):
        link = python / target.name
        if not (link.is_symlink() and link.resolve() == target.resolve()):
            link.unlink(missing_ok=True)
            link.symlink_to(target)
    return TritonBinary(binary, source, backend_dir, {"LD_LIBRARY_PATH": ld_path, **_python_env()})


def _embedded() -> TritonBinary | None:
    try:
        import pytriton
    except ImportError:
        return None
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        return None
    return _assemble(root, root.parent.parent / "nvidia_pytriton.libs", "nvidia-pytriton")


def _found(path: Path, source: str) -> TritonBinary:
    """A tritonserver found by path: the trimmed bundle's (`tritonctl bundle`: stubs beside bin/, libraries in lib/)
    is assembled like the wheel's; any other runs as it is."""
    root = path.resolve().parent.parent
    if (root / "python_backend_stubs").is_dir():
        return _assemble(root, root / "lib", source)
    return TritonBinary(path, source, env=_python_env())


def find_tritonserver(configured: str | None = None) -> TritonBinary:
    """The configured binary, else `tritonserver` on PATH, else the embedded one."""
    if configured:
        path = Path(configured)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise TritonctlError(f"runtime.tritonserver: {configured} is not an executable file")
        return _found(path, "configured")
    on_path = shutil.which("tritonserver")
    if on_path:
        return _found(Path(on_path), "PATH")
    embedded = _embedded()
    if embedded is None:
        raise TritonctlError("no tritonserver found: put one on PATH or `pip install nvidia-pytriton==0.7.0`")
    return embedded
