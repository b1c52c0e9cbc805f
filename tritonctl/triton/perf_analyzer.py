"""NVIDIA perf_analyzer as the independent load generator: every model of a plan at once, open-loop Poisson.

The binary is the one in the tritonclient 2.41.1 manylinux wheel (later wheels no longer ship
it); `make install` puts it under `<venv>/perf-analyzer/bin`. It links `libcudart.so.12` and
`libb64.so.0d` even for CPU-only use; the nvidia-pytriton wheel ships both under hashed names,
so a folder of symlinks with the plain names, on LD_LIBRARY_PATH, is all it needs.

One perf_analyzer process per model, started together, each over three measurement windows
(`-s 1000` takes the first three as stable, so a run lasts about the asked duration). Arrivals
are Poisson, drawn here (seeded per model) and handed over as `--request-intervals`: then the
schedule, and so the number of requests sent, is known exactly (perf_analyzer's own
`--request-rate-range` schedule pauses between windows and exports only answered requests).
Each process writes a profile export (every request's send and response timestamps), read back
into the same `LoadResult` as tritonctl's own client, so both tools report alike.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tritonctl.errors import TritonctlError
from tritonctl.spec import ZERO_INPUTS
from tritonctl.triton.binary import cache_dir
from tritonctl.triton.client import Endpoint, LoadResult
from tritonctl.triton.render import MODEL_VERSION

VERSION = "2.41.1"  # the last tritonclient wheel with bin/perf_analyzer
INSTALL_HINT = (
    "install it with `make install` (it runs: pip install --no-deps --target <venv>/perf-analyzer "
    f"tritonclient=={VERSION}), or put perf_analyzer on PATH, or set TRITONCTL_PERF_ANALYZER"
)
WINDOWS = 3
# A time window in which no request was answered stops perf_analyzer ("No valid requests recorded"); a model
# expecting fewer than this many per window is measured in windows of a request count instead. Poisson arrivals
# leave a window of 12 expected requests empty once in 160,000 (of 5, once in 150: a load that failed now and then).
MIN_PER_WINDOW = 12
LIBS = {"libcudart.so.12": "libcudart-*.so.12*", "libb64.so.0d": "libb64-*.so.0d*"}


class RequestsRefused(TritonctlError):
    """perf_analyzer stopped at a request the server refused (it has no way to count errors and go on); `results`
    holds the models whose runs finished, measured while the stopped ones sent nothing more."""

    def __init__(self, message: str, *, results: list[LoadResult], file: Path | None = None):
        super().__init__(message, file=file)
        self.results = results


@dataclass(frozen=True)
class PerfAnalyzer:
    binary: Path
    env: dict[str, str]


def perf_analyzer_binary() -> Path:
    """TRITONCTL_PERF_ANALYZER, else the one `make install` puts in the environment, else one on PATH."""
    configured = os.environ.get("TRITONCTL_PERF_ANALYZER")
    candidates = (
        [configured]
        if configured
        else [
            str(Path(sys.prefix) / "perf-analyzer" / "bin" / "perf_analyzer"),
            shutil.which("perf_analyzer"),
        ]
    )
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    where = f"TRITONCTL_PERF_ANALYZER={configured} is not an executable file" if configured else "not found"
    raise TritonctlError(f"perf_analyzer: {where}; {INSTALL_HINT}")


def _lib_dir(binary: Path) -> Path | None:
    """A folder of plain-named links to the libraries perf_analyzer links: the trimmed Triton's lib/ beside the
    binary's bin/ (tritonctl bundle), else one made from nvidia-pytriton's bundle."""
    beside = binary.resolve().parent.parent / "lib"
    if all((beside / name).exists() for name in LIBS):
        return beside
    try:
        import pytriton
    except ImportError:
        return None
    bundle = Path(pytriton.__file__).resolve().parent.parent / "nvidia_pytriton.libs"
    folder = cache_dir() / "perf-analyzer-libs"  # the user's own, not a shared /tmp: libraries load from it
    folder.mkdir(parents=True, exist_ok=True)
    for name, pattern in LIBS.items():
        found = sorted(bundle.glob(pattern))
        link = folder / name
        if found and not (link.is_symlink() and link.resolve() == found[0].resolve()):
            link.unlink(missing_ok=True)
            link.symlink_to(found[0])
    return folder


def find_perf_analyzer() -> PerfAnalyzer:
    """perf_analyzer, checked to start here (its libraries found), or a clear error saying what to install."""
    binary = perf_analyzer_binary()
    libs = _lib_dir(binary)
    ld_path = os.pathsep.join(p for p in (str(libs) if libs else "", os.environ.get("LD_LIBRARY_PATH", "")) if p)
    env = {"LD_LIBRARY_PATH": ld_path}
    try:
        probe = subprocess.run([str(binary)], capture_output=True, text=True, env={**os.environ, **env}, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TritonctlError(f"perf_analyzer ({binary}) does not start: {exc}; {INSTALL_HINT}") from None
    if "error while loading shared libraries" in probe.stderr:
        missing = probe.stderr.split("error while loading shared libraries:", 1)[1].split(":", 1)[0].strip()
        raise TritonctlError(
            f"perf_analyzer ({binary}) cannot load {missing}: it comes with nvidia-pytriton "
            "(pip install nvidia-pytriton==0.7.0); libb64.so.0d also from Debian's libb64-0d"
        )
    return PerfAnalyzer(binary, env)


def window_ms(duration_s: float) -> int:
    return max(1000, round(1000 * duration_s / WINDOWS))


def arrivals(rate: float, horizon_s: float, seed: int) -> np.ndarray:
    """Poisson arrival times (s) up to `horizon_s`."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate, size=int(rate * horizon_s * 1.5) + 100)
    times = np.cumsum(gaps)
    while times[-1] < horizon_s:  # rare: draw on until the horizon is covered
        times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(1 / rate, size=len(times)))])
    return times[times < horizon_s]


def write_intervals(path: Path, times: np.ndarray) -> None:
    """perf_analyzer's --request-intervals file: microseconds between successive requests, one per line."""
    gaps_us = np.diff(np.concatenate([[0.0], times])) * 1e6
    path.write_text("\n".join(str(max(1, round(g))) for g in gaps_us) + "\n")


def command(
    pa: PerfAnalyzer, target: Endpoint, intervals: Path, duration_s: float, rate: float, export: Path
) -> list[str]:
    """perf_analyzer's command for one model at `rate`: windows of a third of the duration each, or for a model
    too slow to fill them, windows of as many requests as a third of the duration brings (one at least)."""
    per_window = rate * window_ms(duration_s) / 1000
    if per_window >= MIN_PER_WINDOW:
        windows = ["--measurement-interval", str(window_ms(duration_s))]
    else:
        windows = ["--measurement-mode", "count_windows", "--measurement-request-count", str(max(1, int(per_window)))]
    return [
        str(pa.binary),
        "-m", target.model,
        # The version, named: unnamed, perf_analyzer picks the one whose server-side request count grew over a
        # window, and behind the proxy a window's two statistics may come from two replicas (or from an instance
        # and its shadow during a swap), so that count can fall and it stops ("failed to find the requested
        # model version"). Its server-side figures are unused here.
        "-x", MODEL_VERSION,
        "-u", target.url,
        "-i", "grpc",
        "--async",
        "--request-intervals", str(intervals),
        *windows,
        "--stability-percentage", "1000",
        "--max-trials", str(WINDOWS),
        "--profile-export-file", str(export),
        # integer inputs as tritonctl's own client sends them (`client.random_input`): zeros index any table
        *(["--input-data", "zero"] if target.input_dtype in ZERO_INPUTS else []),
    ]  # fmt: skip


def read_export(path: Path, target: Endpoint, schedule: np.ndarray) -> LoadResult:
    """A LoadResult from perf_analyzer's profile export and the arrival schedule it was given.

    The export holds the requests answered within the measurement windows only: requests still
    queued when perf_analyzer stops are missing from it. The schedule's arrivals after the one
    nearest the last exported request, up to one SLO before the end (an answer due later could
    still be on time), count as unanswered, so an overloaded model is not reported better than
    it was. (A few requests in flight at a window boundary are missing from the export too;
    they are not counted either way.)
    """
    try:
        data = json.loads(path.read_text())
        experiment = data["experiments"][-1]
        start_ns, end_ns = experiment["window_boundaries"][0], experiment["window_boundaries"][-1]
        requests = experiment["requests"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise TritonctlError(f"unreadable perf_analyzer export ({type(exc).__name__}: {exc})", file=path) from None
    result = LoadResult(target.model, target.slo_ms, (end_ns - start_ns) / 1e9)
    for request in sorted(requests, key=lambda r: r["timestamp"]):
        sent = request["timestamp"]
        if not start_ns <= sent < end_ns:
            continue
        result.sent_at_s.append((sent - start_ns) / 1e9)
        answers = request.get("response_timestamps") or []
        if answers:
            result.latencies_ms.append((answers[0] - sent) / 1e6)
            result.answered_at_s.append((answers[0] - start_ns) / 1e9)
        else:
            result.errors.append("no response")
            result.failed_at_s.append((sent - start_ns) / 1e9)
    cutoff = result.duration_s - target.slo_ms / 1000
    # The last exported request is the scheduled arrival nearest to it: perf_analyzer sends about a millisecond
    # off its schedule, on either side of the windows' origin.
    after = int(np.argmin(np.abs(schedule - result.sent_at_s[-1]))) + 1 if result.sent_at_s else 0
    result.unanswered = int(np.sum(schedule[after:] < cutoff))
    return result


def _refusal(model: str, log_text: str, stopped_s: float, duration_s: float) -> str | None:
    """Why perf_analyzer stopped for `model`, where it was at a request the server refused; None otherwise."""
    first = next((line for line in log_text.splitlines() if "had error" in line), None)
    if first is None:
        return None
    error = first.split("had error:", 1)[1].strip()
    why = (
        "the load is beyond what the deployment serves within the SLO, and an overloaded instance refuses what "
        "would be late (runtime.reject_late; false serves every request)"
        if "runtime.reject_late" in error
        else "the model failed on perf_analyzer's input (random values; zeros for integer inputs)"
    )
    return (
        f"{model}: the server refused a request ({error}) and perf_analyzer stopped there, "
        f"after {stopped_s:.0f} s of the {duration_s:.0f} s run: {why}"
    )


def run_perf_analyzer(
    pa: PerfAnalyzer, targets: list[Endpoint], duration_s: float, rate_scale: float, out_dir: Path, seed: int = 0
) -> list[LoadResult]:
    """Load every endpoint at once at rate x scale for about `duration_s`; perf_analyzer's logs stay in out_dir.

    Every run is waited for. Where some stopped at a refused request, RequestsRefused names them and carries
    the others' results; any other failure raises TritonctlError naming the model and its log."""
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    schedules = {}
    started = time.monotonic()
    for i, target in enumerate(targets):
        rate = max(target.rate * rate_scale, 0.1)
        schedules[target.model] = arrivals(rate, 2 * duration_s + 60, seed + i)
        intervals = out_dir / f"{target.model}.intervals"
        write_intervals(intervals, schedules[target.model])
        export = out_dir / f"{target.model}.json"
        export.unlink(missing_ok=True)
        log = (out_dir / f"{target.model}.log").open("w")
        cmd = command(pa, target, intervals, duration_s, rate, export)
        env = {**os.environ, **pa.env}
        procs.append((target, export, log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)))
    ended: dict[str, float] = {}  # seconds from the start to each run's exit
    try:
        deadline = started + 3 * duration_s + 120
        while len(ended) < len(procs) and time.monotonic() < deadline:
            for target, _, _, proc in procs:
                if target.model not in ended and proc.poll() is not None:
                    ended[target.model] = time.monotonic() - started
            time.sleep(0.05)
    finally:
        for _, _, log, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    results, refusals = [], []
    for target, export, _, proc in procs:
        log_path = out_dir / f"{target.model}.log"
        if proc.returncode == 0 and export.is_file():
            results.append(read_export(export, target, schedules[target.model]))
            continue
        text = log_path.read_text(errors="replace")
        refusal = _refusal(target.model, text, ended.get(target.model, 0.0), duration_s)
        if refusal is None:
            rc = proc.returncode if target.model in ended else "killed after a time-out"
            tail = text.strip().splitlines()[-3:]
            raise TritonctlError(f"perf_analyzer for {target.model} failed ({rc}): {' / '.join(tail)}", file=log_path)
        refusals.append((refusal, log_path))
    if refusals:
        measured = (
            f"; {', '.join(r.model for r in results)}: measured without that load from then on" if results else ""
        )
        raise RequestsRefused(
            "; ".join(text for text, _ in refusals)
            + f"{measured}; tritonctl's own client (--tool tritonctl) counts refused requests and goes on",
            results=results,
            file=refusals[0][1] if len(refusals) == 1 else out_dir,
        )
    return results
