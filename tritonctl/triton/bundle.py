"""The trimmed Triton: what of the nvidia-pytriton wheel a server needs, in one archive that travels.

The wheel is 53 MiB and needs pip; a GPU host often has neither the wheel nor a network. The archive holds
tritonserver, the Python backend, the stub for one Python version, the libraries those link (the dynamic
linker's answer here, limited to the wheel's bundled ones; the C library and its kin are the host's), and
NVIDIA perf_analyzer with plain-named links to the two libraries it wants. Unpacked anywhere, put
`<folder>/bin` on PATH (or point `runtime.tritonserver` at `<folder>/bin/tritonserver`): `find_tritonserver`
recognises the layout, and TRITONCTL_PERF_ANALYZER=`<folder>/bin/perf_analyzer` finds its libraries in lib/.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from tritonctl.errors import TritonctlError
from tritonctl.triton.perf_analyzer import LIBS, perf_analyzer_binary

TOP = "tritonserver"  # the archive's one top folder


@dataclass(frozen=True)
class Bundle:
    path: Path
    files: dict[str, int]  # archive member -> bytes (before compression)

    @property
    def unpacked_bytes(self) -> int:
        return sum(self.files.values())


def _wheel_root() -> tuple[Path, Path]:
    try:
        import pytriton
    except ImportError:
        raise TritonctlError(
            "tritonctl bundle trims the nvidia-pytriton wheel: pip install nvidia-pytriton==0.7.0"
        ) from None
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    return root, root.parent.parent / "nvidia_pytriton.libs"


def linked_libraries(binaries: list[Path], libs: Path) -> list[Path]:
    """The libraries of `libs` the binaries load, directly or through one another (ldd's answer)."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(libs)}
    found: set[Path] = set()
    for binary in binaries:
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, env=env).stdout
        for line in out.splitlines():
            parts = line.split("=>")
            if len(parts) == 2 and parts[1].strip().startswith("/"):
                path = Path(parts[1].split("(")[0].strip()).resolve()
                if path.parent == libs.resolve():
                    found.add(path)
    return sorted(found)


def members(python_version: str) -> dict[str, Path]:
    """Archive member (under TOP) -> the file it is made of."""
    root, libs = _wheel_root()
    stub = root / "python_backend_stubs" / python_version / "triton_python_backend_stub"
    if not stub.is_file():
        versions = sorted(p.name for p in (root / "python_backend_stubs").iterdir())
        raise TritonctlError(f"--python {python_version}: the wheel has stubs for Python {', '.join(versions)}")
    perf_analyzer = perf_analyzer_binary()
    binaries = [root / "bin" / "tritonserver", root / "backends" / "python" / "libtriton_python.so", stub]
    out = {
        "bin/tritonserver": binaries[0],
        "bin/perf_analyzer": perf_analyzer,
        "backends/python/libtriton_python.so": binaries[1],
        "backends/python/triton_python_backend_utils.py": root
        / "backends"
        / "python"
        / "triton_python_backend_utils.py",
        f"python_backend_stubs/{python_version}/triton_python_backend_stub": stub,
    }
    for lib in linked_libraries(binaries, libs):
        out[f"lib/{lib.name}"] = lib
    for plain, pattern in LIBS.items():  # perf_analyzer wants these under their plain names
        matches = sorted(libs.glob(pattern))
        if not matches:
            raise TritonctlError(f"nvidia-pytriton's libraries hold no {pattern} (perf_analyzer needs {plain})")
        out[f"lib/{plain}"] = matches[0]
    return out


def bundle(output: Path, python_version: str, preset: int = 6, files: dict[str, Path] | None = None) -> Bundle:
    """Write the trimmed Triton for Python `python_version` (the GPU host's) to `output` (.tar.xz, xz `preset`);
    `files`: its `members`, where already read."""
    files = files or members(python_version)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".partial")
    sizes = {}
    with tarfile.open(tmp, "w:xz", preset=preset) as tar:
        for name, source in sorted(files.items()):
            info = tar.gettarinfo(str(source), arcname=f"{TOP}/{name}")
            info.mode = 0o755 if name.startswith("bin/") or name.endswith("_stub") else 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = 0
            with source.open("rb") as fh:
                tar.addfile(info, fh)
            sizes[name] = info.size
        manifest = json.dumps({"python": python_version, "files": sizes}, indent=1, sort_keys=True).encode()
        info = tarfile.TarInfo(f"{TOP}/manifest.json")
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
    tmp.replace(output)
    return Bundle(output, sizes)
