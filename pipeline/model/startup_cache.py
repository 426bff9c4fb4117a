"""What a quantized start derives from a model file on a given CPU, kept on disk so the next start reuses it.

A `model.quant=auto` start does the same work for the same file on the same machine every time: the
hardware probe, the calibration pass, GPTQ rounding and smoothing of the W8A8 weights, timing the int8
GEMMs and the weight-only/W8A8 switch point, torch.compile's check of the CPU's vector instructions. Each
result is an entry here, read at the next start instead of being recomputed (SmolLM2 on 2 cores: ~12 s of
load down to a few).

Entries are keyed by everything their value depends on (`StartupCache.key`): the model file's content hash
(xxh3-128, remembered per path, size and modification time so a large file is hashed once), the load
settings, the CPU's model and flags, the torch version and a digest of this package's model and kernel
sources (a changed quantizer never reads an old entry). An entry is a payload file and a `.seal` file
written after it, each by an atomic rename; a reader checks the payload's size and hash against it, so a
truncated or damaged entry is rebuilt, never trusted. The hash is xxh3-128 (the `xxhash` package), not a
cryptographic one: it guards against damage, not tampering (the folder must be trusted anyway, below), and
it checks a 1B model's 2.7 GB entry ~5x faster than sha256 did (1.7 s against 8.4 s on a busy 2-core
machine), most of a warm start's check. Jobs sharing a cache folder (Slurm tasks on one node) build an entry
once: the first takes the entry's file lock and builds, the others wait and read. A model file whose hash is
not remembered yet is hashed in a thread while the model is built (`fetch_for_file`), so its first start
reads it from the disk once, not once to hash it and again to load it.

The folder is kept under a size budget (`model.startup_cache_max_size`): after an entry is written, the
entries used longest ago (read or written: their seal's modification time) are deleted until the rest fit,
so entries of an older package version or another model file do not pile up (a 1B model's entry is ~2 GB).

Model entries are pickles (`torch.save` of the module): load them only from a folder you trust, as you
would the model file itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import torch
import xxhash
from filelock import FileLock
from torch.utils.serialization import config as serialization_config

from kernels.native_build import cpu_identity
from pipeline import __version__
from pipeline.model.remote import package_cache_dir

log = logging.getLogger(__name__)

T = TypeVar("T")
_CHUNK = 8 << 20
DEFAULT_MAX_BYTES = 10 << 30
_SOURCE_ROOTS = ("pipeline/model", "kernels")  # the code that shapes what an entry holds


@cache
def code_digest() -> str:
    """sha256 over this package's model and kernel sources (and its version): part of every key."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256(__version__.encode())
    for folder in _SOURCE_ROOTS:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in (".py", ".c", ".h", ".txt") and path.is_file():
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


class DamagedEntry(Exception):
    """An entry whose payload does not match its recorded size and hash (or cannot be decoded)."""


class StaleEntry(Exception):
    """An entry whose value is to be computed again (`StartupCache.fetch`'s `stale`)."""


def cpus_busy() -> bool:
    """Whether other work competes for the CPUs this process may use: the 1-minute load average above their
    count. A job's own threads count at most one per CPU, so a machine running only the job is not busy; the
    figures timed on a busy one came out 3-10x slow on 2 cores, enough to turn the load's choices around."""
    return os.getloadavg()[0] > len(os.sched_getaffinity(0))


class StartupCache:
    """One cache folder; `fetch` reads an entry or builds and stores it."""

    def __init__(self, root: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES):
        self.root = Path(root).expanduser() if root else package_cache_dir("startup")
        self.max_bytes = max_bytes
        self.read = self.built = 0  # entries this process read, and built (reported in _metrics.json)

    def as_dict(self) -> dict[str, Any]:
        return {"dir": str(self.root), "entries_read": self.read, "entries_built": self.built}

    def key(self, kind: str, **parts: Any) -> str:
        """A name for an entry of `kind` whose value depends on `parts` (JSON values), this CPU, torch and
        this package's sources."""
        return _name(kind, parts=parts, cpu=cpu_identity(), torch=torch.__version__, code=code_digest())

    def file_hash(self, path: str | Path) -> str:
        """The content hash of a model file (or of a directory's files, in name order), remembered in the cache by
        path, size and modification time so each version of a large file is read once."""
        memo, files = _hash_memo(path)
        return self.fetch(memo, lambda: _content_hash(files), *JSON_ENTRY)

    def fetch_for_file(self, path: str | Path, kind: str, parts: dict[str, Any], build: Callable[[], T],
                       dump: Callable[[T, BinaryIO], None], load: Callable[[Path], T]) -> tuple[T, str]:
        """`fetch` of the entry keyed by `kind`, `parts` and the content hash of the model file at `path`, and
        that key. Where the file's hash is not remembered yet (its first start, or the file changed), the
        file is hashed in a thread while `build` runs, then the value is stored under the key the hash
        gives, unless an entry is there already (the same bytes at another path or time): a cold disk's
        read of a 4 GB file (~9 s) overlaps the load, which then finds the pages cached. Jobs sharing the
        folder that start on such a file at once each build it (the key that would lock it is not known
        before the hash)."""
        memo, _ = _hash_memo(path)
        try:
            known = self._read(memo, _load_json, lambda value: False)
        except (OSError, DamagedEntry, StaleEntry):
            known = None
        if known is not None:
            key = self.key(kind, file=known, **parts)
            return self.fetch(key, build, dump, load), key
        with ThreadPoolExecutor(1, thread_name_prefix="startup-cache-hash") as pool:
            hashed = pool.submit(self.file_hash, path)
            self.built += 1
            value = build()
            key = self.key(kind, file=hashed.result(), **parts)
        self._store(key, value, dump)
        return value, key

    def fetch(self, name: str, build: Callable[[], T], dump: Callable[[T, BinaryIO], None],
              load: Callable[[Path], T], stale: Callable[[T], bool] = lambda value: False) -> T:
        """The entry `name` decoded by `load` (from its file), or `build()` stored (written by `dump`) and
        returned. A damaged entry is logged and rebuilt, and so is one whose value is `stale`; a folder
        that cannot be written is logged and skipped."""
        try:
            value = self._read(name, load, stale)
            self.read += 1
            return value
        except OSError:  # never written (or not readable): build it
            pass
        except StaleEntry:
            log.info("startup cache entry %s was timed while other work shared the CPUs: timing it again",
                     self.root / name)
        except DamagedEntry as e:
            log.warning("startup cache entry %s is damaged (%s): rebuilding it", self.root / name, e)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(self.root / f"{name}.lock"))
            lock.acquire()
        except OSError as e:
            log.warning("startup cache %s is not writable (%s): computing without it", self.root, e)
            return build()
        try:
            try:
                value = self._read(name, load, stale)  # another job built it while this one waited
                self.read += 1
                return value
            except (OSError, DamagedEntry, StaleEntry):
                pass
            self.built += 1
            value = build()
            self._write_or_warn(name, value, dump)
            return value
        finally:
            lock.release()

    def fetch_timing(self, name: str, measure: Callable[[], Any]) -> Any:
        """A JSON value timed on this machine (the probe's peaks, the GEMM choice, the switch point), read
        back at later starts. One timed while other work competed for the CPUs (`cpus_busy`) is timed again
        at the first start that finds them free, so a busy first start does not fix its choices for good."""
        free = not cpus_busy()

        def timed() -> dict[str, Any]:
            value = measure()
            return {"value": value, "busy": cpus_busy()}

        return self.fetch(name, timed, *JSON_ENTRY, stale=lambda entry: free and entry["busy"])["value"]

    def _store(self, name: str, value: T, dump: Callable[[T, BinaryIO], None]) -> None:
        """Write entry `name` under its lock unless a seal is there (an entry another job or an earlier start
        wrote: a read judges it); a folder that cannot be written is logged and skipped."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with FileLock(str(self.root / f"{name}.lock")):
                if not (self.root / f"{name}.seal").exists():
                    self._write_or_warn(name, value, dump)
        except OSError as e:
            log.warning("startup cache %s is not writable (%s): the next start recomputes it", self.root, e)

    def _write_or_warn(self, name: str, value: T, dump: Callable[[T, BinaryIO], None]) -> None:
        """`_write`, a failure logged: the job goes on with the value it built."""
        try:
            self._write(name, value, dump)
        except OSError as e:
            log.warning("cannot write startup cache entry %s (%s): the next start recomputes it",
                        self.root / name, e)

    def _read(self, name: str, load: Callable[[Path], T], stale: Callable[[T], bool]) -> T:
        """The entry's value; OSError where it was never written, DamagedEntry where it does not check out,
        StaleEntry where `stale` rejects it."""
        seal = (self.root / f"{name}.seal").read_text().split()
        path = self.root / name
        found = [str(path.stat().st_size), _content_hash([path])]
        if seal != found:
            raise DamagedEntry(f"{found[0]} bytes that do not match the recorded size and hash")
        try:
            value = load(path)
        except Exception as e:  # a payload that hashes right but does not decode: written by other code
            raise DamagedEntry(f"cannot decode it: {e}") from None
        if stale(value):
            raise StaleEntry
        with contextlib.suppress(OSError):  # a folder this job may read but not write is still read
            (self.root / f"{name}.seal").touch()  # used now: the last to be evicted
        return value

    def _write(self, name: str, value: T, dump: Callable[[T, BinaryIO], None]) -> None:
        """The payload, then its seal, each written to a temporary file and renamed into place. The payload is
        hashed as it is written, not read back (a 1B model's 2.7 GB entry: ~2 s of a busy first start)."""
        path = self.root / name
        written = _atomic_write(path, lambda f: _hashing_dump(value, f, dump))
        seal = f"{written.size} {written.digest.hexdigest()}\n".encode()
        _atomic_write(self.root / f"{name}.seal", lambda f: f.write(seal))
        self._evict(keep=name)

    def _evict(self, keep: str) -> None:
        """Delete the entries used longest ago (by their seal's modification time) until the folder's entries
        fit `max_bytes`; never `keep`, the entry just written. An entry another job has open stays readable
        to it (its file is unlinked, not overwritten)."""
        entries = []
        for seal in self.root.glob("*.seal"):
            payload = seal.with_suffix("")
            try:
                entries.append((seal.stat().st_mtime_ns, payload.stat().st_size, payload, seal))
            except OSError:  # removed meanwhile, or a seal without its payload
                continue
        total = sum(size for _, size, _, _ in entries)
        for _, size, payload, seal in sorted(entries, key=lambda e: e[0]):
            if total <= self.max_bytes:
                break
            if payload.name == keep:
                continue
            seal.unlink(missing_ok=True)
            payload.unlink(missing_ok=True)
            total -= size
            log.info("startup cache: evicted %s (%.1f MB) to keep the folder under %.1f GB", payload.name,
                     size / 1e6, self.max_bytes / 1e9)


def _name(kind: str, **ident: Any) -> str:
    return f"{kind}-{hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]}"


def _atomic_write(path: Path, write: Callable[[BinaryIO], T]) -> T:
    """What `write` returns, having written the file through it to a temporary file renamed into place.
    Not fsynced: a payload a crash left short or stale fails its seal's check at the next read and is
    rebuilt, and waiting for the disk took 2-7 s of a 1B model's first start (its 2.7 GB entry)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            result = write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return result


def _hashing_dump(value: T, f: BinaryIO, dump: Callable[[T, BinaryIO], None]) -> _HashingWriter:
    """`dump(value, f)` through a `_HashingWriter`, returned with the hash and size of what it wrote."""
    writer = _HashingWriter(f)
    dump(value, writer)
    return writer


class _HashingWriter:
    """A binary file's writer that hashes (`_content_hash`'s xxh3-128) and counts the bytes written through
    it, in order: the seal of a file written by appending alone, as torch.save and json writes do."""

    def __init__(self, f: BinaryIO):
        self._f = f
        self.digest = xxhash.xxh3_128()
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        self.digest.update(data)
        self.size += memoryview(data).nbytes
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def _hash_memo(path: str | Path) -> tuple[str, list[Path]]:
    """The name of the entry remembering the content hash of the file (or directory) at `path`, by each
    file's path, size and modification time, and those files in name order."""
    path = Path(path).resolve()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    stamp = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return _name("hash", stamp=stamp), files  # the content's hash depends on the content alone


def _content_hash(files: list[Path]) -> str:
    """xxh3-128 of the files' bytes in order, read into one reused buffer: a read waits for the disk with
    the GIL released (a page fault of a mapped file holds it), so a hash in a thread leaves the load free."""
    digest = xxhash.xxh3_128()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                digest.update(view[:n])
    return digest.hexdigest()


def _dump_json(value: Any, f: BinaryIO) -> None:
    f.write(json.dumps(value, sort_keys=True).encode())


def _load_json(path: Path) -> Any:
    return json.loads(path.read_bytes())


JSON_ENTRY = (_dump_json, _load_json)  # (dump, load) of an entry holding a JSON value


def _dump_module(module: torch.nn.Module, f: BinaryIO) -> None:
    # without the zip records' CRC-32: the seal's hash already checks every byte, and the CRC pass took a
    # third to a half of writing a 1B model's entry (1 GB: 1.1-1.4 s against 1.8-3.4 s)
    with serialization_config.patch({"save.compute_crc32": False}):
        try:
            torch.save(module, f)
        except RuntimeError as e:  # its writer's failures (a full disk: "unexpected pos ...") are not OSErrors
            raise OSError(f"torch.save failed: {e}") from e


def _load_module(path: Path) -> torch.nn.Module:
    return torch.load(path, weights_only=False, mmap=True)


MODULE_ENTRY = (_dump_module, _load_module)  # a whole module (`torch.save`, pickled: a trusted folder only)
