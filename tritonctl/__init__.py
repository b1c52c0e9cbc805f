"""tritonctl: plan, render and apply dense NVIDIA Triton deployments.

Installed, the package holds `tritonctl.profiler`, `tritonctl.rl` and `tritonctl.templates`
(setup.cfg maps the repository's `profiler/`, `rl/` and `templates/` folders onto them). In a
checkout used as it is (tests, the GPU host's working copy), those folders sit beside this one
and are found there.
"""

from pathlib import Path

__version__ = "0.1.0"

_CHECKOUT = Path(__file__).resolve().parent.parent
if not (Path(__file__).parent / "profiler").is_dir() and (_CHECKOUT / "profiler" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT))
