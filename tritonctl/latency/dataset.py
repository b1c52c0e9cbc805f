"""The profile dataset on disk: a tidy CSV of measurements, a CSV of model features, metadata.

    <dir>/metadata.json     format and version, cluster, device fingerprint, software
                            versions, share mechanism, grid, date, whether it is complete
    <dir>/measurements.csv  one row per (configuration, model): kind solo|coloc, split
                            train|heldout|repeat, batch, share, co-runners, p50/p95/p99/mean client
                            latency, Triton's server-side compute and queue time, memory
    <dir>/models.csv        per model: operators, input/output/weight/activation bytes
    <dir>/memory.csv        per instance warm-up: resident memory after each batch size
    <dir>/wake.csv          per model: median latency of single requests sent after an idle gap
    <dir>/requests.csv      per model: CPU a batch-1 request costs outside the model (Triton's front
                            end, HAProxy)

Rows are appended as they are measured, so an interrupted profile resumes where it stopped.
The CSVs read with the csv module or pandas.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from tritonctl.errors import TritonctlError
from tritonctl.files import read_json

FORMAT = "tritonctl-profile"
VERSION = 1


@dataclass(frozen=True)
class Measurement:
    config_id: str  # the run: co-located members share it
    kind: str  # solo | coloc
    split: str  # train | heldout | repeat (a held-out configuration measured again, last)
    model: str
    batch: int
    share: int  # device units
    units: int
    cores: float
    threads: int
    corunners: str  # "model:share:batch;..." (empty when solo)
    n_colocated: int  # models running on the device, this one included
    reps: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    mean_ms: float
    compute_ms: float  # Triton's compute_input + compute_infer + compute_output per batch
    queue_ms: float
    rss_mb: float  # resident memory of the instance after this batch size (solo rows)
    cpu_util: float  # cores the instance kept busy meanwhile (/proc user + system time)

    @property
    def share_frac(self) -> float:
        return self.share / self.units

    def corunner_list(self) -> list[tuple[str, int, int]]:
        out = []
        for item in filter(None, self.corunners.split(";")):
            name, share, batch = item.split(":")
            out.append((name, int(share), int(batch)))
        return out


@dataclass(frozen=True)
class MemoryPoint:
    """Resident memory of a fresh instance after it first ran `batch` (its warm-up pass)."""

    model: str
    threads: int
    batch: int
    rss_mb: float


@dataclass(frozen=True)
class WakePoint:
    """Median latency of batch-1 requests to an instance with the whole device, each sent `gap_ms` after the
    previous answer: an instance left idle answers its next request slower than one kept busy."""

    model: str
    gap_ms: float
    p50_ms: float


@dataclass(frozen=True)
class RequestCost:
    """CPU milliseconds one batch-1 request of `model` costs outside the model's own process, over `requests`
    sent through HAProxy after idle gaps: Triton's front end (its server process; the model runs in the
    backend stub) and HAProxy. The plan reserves cores for them in proportion to the request rate."""

    model: str
    requests: int
    server_cpu_ms: float
    proxy_cpu_ms: float

    @property
    def cpu_ms(self) -> float:
        return self.server_cpu_ms + self.proxy_cpu_ms


@dataclass(frozen=True)
class ModelFeatures:
    model: str
    onnx_sha256: str
    n_ops: int
    input_bytes: int
    output_bytes: int
    weight_bytes: int
    activation_bytes: int


def _typed(cls, row: dict[str, str], where: str):
    values = {}
    for f in fields(cls):
        if f.name not in row:
            raise TritonctlError(f"missing column {f.name!r}", file=where)
        raw = row[f.name]
        try:
            value = {"int": int, "float": float}.get(f.type, str)(raw)
        except (ValueError, TypeError):  # TypeError: a short row leaves the column None
            raise TritonctlError(f"column {f.name!r}: {raw!r} is not a {f.type}", file=where) from None
        if f.type == "float" and f.name != "rss_mb" and not math.isfinite(value):
            raise TritonctlError(f"column {f.name!r}: {raw!r} is not a finite number", file=where)
        if f.type in ("int", "float") and value < 0:  # times, counts, sizes, shares: none is below 0
            raise TritonctlError(f"column {f.name!r}: {raw!r} is negative", file=where)
        values[f.name] = value
    return cls(**values)


def _read_csv(path: Path, cls) -> list:
    try:
        with path.open(newline="") as fh:
            return [_typed(cls, row, f"{path} (line {i + 2})") for i, row in enumerate(csv.DictReader(fh))]
    except OSError as exc:
        raise TritonctlError(f"cannot read: {exc.strerror}", file=path) from None
    except csv.Error as exc:
        raise TritonctlError(f"not a valid CSV file: {exc}", file=path) from None


class Dataset:
    """A profile folder: metadata, model features and measurements."""

    def __init__(
        self,
        folder: Path,
        metadata: dict,
        models: dict[str, ModelFeatures],
        rows: list[Measurement],
        memory: list[MemoryPoint],
        wake: list[WakePoint] = (),
        requests: list[RequestCost] = (),
    ):
        self.folder = folder
        self.metadata = metadata
        self.models = models
        self.rows = rows
        self.memory = memory
        self.wake = list(wake)
        self.requests = list(requests)

    @property
    def done(self) -> set[tuple[str, str]]:
        return {(row.config_id, row.model) for row in self.rows}

    @staticmethod
    def create(folder: Path, metadata: dict, models: list[ModelFeatures]) -> Dataset:
        folder.mkdir(parents=True, exist_ok=True)
        metadata = {"format": FORMAT, "version": VERSION, **metadata}
        dataset = Dataset(folder, metadata, {m.model: m for m in models}, [], [])
        dataset.write_metadata()
        with (folder / "models.csv").open("w", newline="") as fh:
            writer = csv.DictWriter(fh, [f.name for f in fields(ModelFeatures)])
            writer.writeheader()
            writer.writerows(asdict(m) for m in models)
        for name, cls in (
            ("measurements.csv", Measurement),
            ("memory.csv", MemoryPoint),
            ("wake.csv", WakePoint),
            ("requests.csv", RequestCost),
        ):
            with (folder / name).open("w", newline="") as fh:
                csv.DictWriter(fh, [f.name for f in fields(cls)]).writeheader()
        return dataset

    def write_metadata(self) -> None:
        tmp = self.folder / "metadata.json.tmp"
        tmp.write_text(json.dumps(self.metadata, indent=2, sort_keys=True) + "\n")
        tmp.replace(self.folder / "metadata.json")

    def append(
        self,
        rows: list[Measurement],
        memory: list[MemoryPoint] = (),
        wake: list[WakePoint] = (),
        requests: list[RequestCost] = (),
    ) -> None:
        for name, cls, items, target in (
            ("measurements.csv", Measurement, rows, self.rows),
            ("memory.csv", MemoryPoint, memory, self.memory),
            ("wake.csv", WakePoint, wake, self.wake),
            ("requests.csv", RequestCost, requests, self.requests),
        ):
            path = self.folder / name
            new = not path.exists()  # wake.csv, requests.csv: profiles from before they were measured lack them
            with path.open("a", newline="") as fh:
                writer = csv.DictWriter(fh, [f.name for f in fields(cls)])
                if new:
                    writer.writeheader()
                for item in items:
                    writer.writerow({k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(item).items()})
            target.extend(items)


def load_dataset(folder: str | Path) -> Dataset:
    """Read and check a profile folder; a corrupt or foreign one is refused with the file named."""
    folder = Path(folder)
    meta_path = folder / "metadata.json"
    if folder.is_file():
        raise TritonctlError("a file, not a profile folder (tritonctl profile writes one)", file=folder)
    if not folder.is_dir():
        raise TritonctlError("no such profile folder", file=folder)
    if not meta_path.exists():
        raise TritonctlError("not a profile folder: no metadata.json in it (tritonctl profile writes one)", file=folder)
    metadata = read_json(meta_path)
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise TritonctlError(f"not a tritonctl profile (format is not {FORMAT!r})", file=meta_path)
    if not isinstance(metadata.get("device"), dict) or "kind" not in metadata["device"]:
        raise TritonctlError("no `device` with its `kind`: not a complete profile", file=meta_path)
    if metadata.get("version") != VERSION:
        raise TritonctlError(
            f"profile format version {metadata.get('version')}, this tritonctl reads {VERSION}", file=meta_path
        )
    models = {m.model: m for m in _read_csv(folder / "models.csv", ModelFeatures)}
    rows = _read_csv(folder / "measurements.csv", Measurement)
    for line, row in enumerate(rows, start=2):
        try:
            row.corunner_list()
        except ValueError:
            raise TritonctlError(
                f"column 'corunners': {row.corunners!r} is not model:share:batch;...",
                file=f"{folder / 'measurements.csv'} (line {line})",
            ) from None
    unknown = sorted({row.model for row in rows} - set(models))
    if unknown:
        raise TritonctlError(
            f"measurements of models without features: {', '.join(unknown)}", file=folder / "measurements.csv"
        )
    wake = _read_csv(folder / "wake.csv", WakePoint) if (folder / "wake.csv").exists() else []
    requests = _read_csv(folder / "requests.csv", RequestCost) if (folder / "requests.csv").exists() else []
    return Dataset(folder, metadata, models, rows, _read_csv(folder / "memory.csv", MemoryPoint), wake, requests)
