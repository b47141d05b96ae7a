"""Where `run` reads INPUT and writes OUTPUT when they are not plain local files: `-` (stdin, stdout), object-store
and other fsspec URLs (`s3://`, `gs://`, `memory://`, ...) and Hugging Face datasets (a Hub id).

The job reads INPUT twice (the whole-file checks, then the rows), so stdin, a URL and a Hub dataset are first copied
into a local temporary file or folder that lives as long as the job. A remote OUTPUT is written to a local
temporary file and uploaded when the job ends, however it ends: an object store has no append and no lock, and a
single upload replaces the object whole, so no reader sees half a file. For the same reasons there is no
`--resume` into a remote OUTPUT (write a local one, which resumes, and copy it), and a remote OUTPUT that exists
is replaced only with `--overwrite`.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from nanovllm_cli.readers import detect_format, is_dataset_folder, pick_split

STDIO = "-"


def url_protocol(location: str) -> str | None:
    """The fsspec protocol of a URL (`s3`, `gs`, `memory`, ...), None for a local path (or `file://`)."""
    if "://" not in location:
        return None
    protocol = location.split("://", 1)[0].lower()
    return None if protocol in ("file", "local") else protocol


def local_path(location: str) -> Path:
    """The local file a location without a remote protocol names (`file:///data/x.jsonl` is /data/x.jsonl)."""
    if "://" in location:
        import fsspec

        return Path(fsspec.core.url_to_fs(location)[1])
    return Path(location)


def _filesystem_error(location: str, exc: BaseException) -> ValueError:
    """A remote path's failure as one line saying what to do."""
    if isinstance(exc, ImportError):  # fsspec names the package a protocol needs
        extra = " (pip install 'nanovllm[ray]' brings s3fs and gcsfs)" if url_protocol(location) in ("s3", "gs",
                                                                                                        "gcs") else ""
        return ValueError(f"cannot open {location}: {exc}{extra}")
    if isinstance(exc, FileNotFoundError):
        return ValueError(f"{location} does not exist")
    if isinstance(exc, ValueError) and "protocol" in str(exc).lower():
        return ValueError(f"cannot open {location}: unknown protocol {url_protocol(location)!r}")
    return ValueError(f"cannot use {location}: {type(exc).__name__}: {exc}")


def _filesystem(location: str):
    import fsspec

    try:
        return fsspec.core.url_to_fs(location)
    except (ImportError, ValueError) as exc:
        raise _filesystem_error(location, exc) from None


@dataclass
class InputLocation:
    """INPUT as a local file or folder the job reads (a temporary copy for stdin, a URL or a Hub dataset)."""

    name: str  # as the user gave it, for messages and the summary
    path: Path
    fmt: str
    split: str | None = None  # of a datasets folder
    local: bool = True  # INPUT is this local file: OUTPUT defaults to beside it and may not be it
    _temp: tempfile.TemporaryDirectory | None = field(default=None, repr=False)

    def default_output(self) -> str:
        """Results beside INPUT, in its format where `run` writes it: prompts.jsonl -> prompts.results.jsonl,
        prompts.parquet -> prompts.results.parquet, another name (prompts.csv, a datasets folder) gets
        .results.jsonl after its whole name. stdin: stdout."""
        if self.name == STDIO:
            return STDIO
        if self.fmt == "datasets" and not self.local:
            raise ValueError(f"a Hub dataset has no folder to write beside: give -o OUTPUT for {self.name}")
        name = PurePosixPath(self.name.rstrip("/")).name
        stem, suffix = name.rsplit(".", 1) if "." in name else (name, "")
        if suffix.lower() in ("jsonl", "ndjson", "parquet"):
            name = f"{stem}.results.{'parquet' if suffix.lower() == 'parquet' else 'jsonl'}"
        else:
            name = f"{name}.results.jsonl"
        head = self.name.rstrip("/")
        return head[:len(head) - len(PurePosixPath(head).name)] + name

    def close(self) -> None:
        if self._temp is not None:
            self._temp.cleanup()
            self._temp = None


def open_input(location: str, input_format: str | None, split: str | None = None) -> InputLocation:
    """INPUT made readable twice: a local file or datasets folder as it is, anything else copied. Raises
    ValueError saying what is wrong (no such file, a package to install, offline for a Hub dataset)."""
    if location == STDIO:
        temp = tempfile.TemporaryDirectory(prefix="nanovllm-input-")
        fmt = input_format or "jsonl"
        path = Path(temp.name) / f"stdin.{fmt}"
        with open(path, "wb") as out:
            shutil.copyfileobj(sys.stdin.buffer, out, 1 << 20)
        return InputLocation(STDIO, path, detect_format(path, fmt), local=False, _temp=temp)
    if url_protocol(location) is not None:
        fs, remote = _filesystem(location)
        fmt = detect_format(Path(PurePosixPath(remote).name), input_format)
        temp = tempfile.TemporaryDirectory(prefix="nanovllm-input-")
        path = Path(temp.name) / (PurePosixPath(remote).name or "input")
        try:
            fs.get_file(remote, str(path))
        except Exception as exc:  # noqa: BLE001 (each filesystem raises its own: one line naming INPUT)
            temp.cleanup()
            raise _filesystem_error(location, exc) from None
        return InputLocation(location, path, fmt, local=False, _temp=temp)
    path = local_path(location)
    if input_format == "datasets" and not path.exists():
        return _hub_dataset(location, split)
    if not path.exists():
        raise ValueError(f"INPUT {path} does not exist")
    if path.is_dir() and not is_dataset_folder(path):
        raise ValueError(f"INPUT {path} is a directory: a directory or a glob needs --ray (a Hugging Face datasets "
                         "folder, saved with save_to_disk, is read as one)")
    return InputLocation(location, path, detect_format(path, input_format), split)


def _hub_dataset(name: str, split: str | None) -> InputLocation:
    """A Hugging Face Hub dataset, loaded through `datasets` and saved into a temporary folder."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"INPUT {name} does not exist (a Hub dataset needs the datasets package: pip install "
                         "datasets)") from None
    try:
        loaded = datasets.load_dataset(name, split=split)
    except Exception as exc:  # noqa: BLE001 (offline, unknown, gated: datasets raises many kinds)
        raise ValueError(f"cannot load the dataset {name!r} from the Hugging Face Hub ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); offline or behind a firewall, "
                         "save it with Dataset.save_to_disk where the Hub is reachable and pass that folder") from None
    dataset = pick_split(loaded, None, name)
    temp = tempfile.TemporaryDirectory(prefix="nanovllm-input-")
    path = Path(temp.name) / "dataset"
    dataset.save_to_disk(str(path))
    return InputLocation(name, path, "datasets", local=False, _temp=temp)


@dataclass
class OutputLocation:
    """OUTPUT as the job writes it: a local file (`path`), stdout, or a remote URL staged in a local file."""

    name: str
    path: Path | None  # None: stdout
    remote: str | None = None  # the URL `path` is uploaded to when the job ends
    _temp: tempfile.TemporaryDirectory | None = field(default=None, repr=False)

    @property
    def stdout(self) -> bool:
        return self.path is None

    def upload(self) -> None:
        """Put the staged file at the remote URL (when there is one and the job wrote it)."""
        if self.remote is None or not self.path.exists():
            return
        fs, remote = _filesystem(self.remote)
        try:
            fs.put_file(str(self.path), remote)
        except Exception as exc:  # noqa: BLE001 (each filesystem raises its own)
            raise _filesystem_error(self.remote, exc) from None

    def close(self) -> None:
        if self._temp is not None:
            self._temp.cleanup()
            self._temp = None


def open_output(location: str, *, resume: bool, overwrite: bool) -> OutputLocation:
    """OUTPUT as the job writes it; ValueError for what cannot be done there (resume into stdout or a URL)."""
    if location == STDIO:
        if resume:
            raise ValueError("--resume, --retry-failed and --sync read OUTPUT back: they need a file, not stdout (-o -)")
        return OutputLocation(STDIO, None)
    if url_protocol(location) is None:
        return OutputLocation(location, local_path(location))
    if resume:
        raise ValueError(f"--resume, --retry-failed and --sync cannot use {location}: an object store has no append or "
                         "lock; write a local OUTPUT (which resumes) and copy it there")
    fs, remote = _filesystem(location)
    try:
        exists = fs.exists(remote)
    except Exception as exc:  # noqa: BLE001 (each filesystem raises its own)
        raise _filesystem_error(location, exc) from None
    if exists and not overwrite:
        raise ValueError(f"OUTPUT {location} exists: add --overwrite to replace it")
    temp = tempfile.TemporaryDirectory(prefix="nanovllm-output-")
    return OutputLocation(location, Path(temp.name) / PurePosixPath(remote).name, remote=location, _temp=temp)
