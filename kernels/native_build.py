"""Build the native CPU kernels (`kernels/*.c`) with the system C compiler, once per source, flags, compiler
and CPU, into a shared library cached on disk and loaded through ctypes.

Why this way: the kernels take raw pointers, so no torch headers and no extension toolchain are needed, and
a build takes about a second. `-march=native` compiles for the CPU the job runs on; the cache key holds the
CPU's model and flags, so a cache directory shared by different machines keeps one library per CPU. The
libraries use the OpenMP runtime torch has already loaded, so they share torch's threads and their count.

`$PIPELINE_KERNEL_FLAGS` adds compiler flags after those (and to the cache key): `-mno-avx512f` builds the
AVX2 paths on an AVX-512 CPU, as the tests do (tests/kernels/conftest.py), where the kernels that need
AVX-512 then report themselves unavailable.

`$PIPELINE_NATIVE` is the one switch for debugging them: unset (or `on`) every native kernel runs where it
can; `off` none; a comma-separated list (`gemm,attention`) keeps only those named of NATIVE_PARTS. The
torch paths they replace give the same results (the GEMM bit for bit, attention and the decoder layers to
float32 rounding), so the switch moves speed, and at most the last float32 bits.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
EXTRA_FLAGS = "PIPELINE_KERNEL_FLAGS"
SWITCH = "PIPELINE_NATIVE"
# the native kernels $PIPELINE_NATIVE names: the VNNI int8 GEMM, the decoder layers, the paged attention,
# the W4A8 GEMM of small steps, the load-time weight quantizers
NATIVE_PARTS = ("gemm", "decode", "attention", "w4a8", "quantize")


def build_flags() -> tuple[str, ...]:
    """FLAGS, then those of $PIPELINE_KERNEL_FLAGS (later flags win: `-mno-avx512f` after `-march=native`)."""
    return (*FLAGS, *shlex.split(os.environ.get(EXTRA_FLAGS, "")))


def c_compiler() -> str | None:
    """$CC, else gcc, else cc, if installed."""
    found = (shutil.which(name) for name in (os.environ.get("CC"), "gcc", "cc") if name)
    return next((path for path in found if path), None)


def cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model name and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown cpu"
    return "\n".join(dict.fromkeys(ln for ln in lines if ln.startswith(("model name", "flags"))))


def native_parts() -> tuple[str, ...]:
    """The native kernels $PIPELINE_NATIVE keeps (NATIVE_PARTS order): all where it is unset, `on` or `all`;
    none for `off`; else those it lists. ValueError naming any other word."""
    value = os.environ.get(SWITCH, "").strip().lower()
    if value in ("", "on", "all"):
        return NATIVE_PARTS
    if value in ("off", "none"):
        return ()
    named = {word.strip() for word in value.split(",")} - {""}
    unknown = sorted(named - set(NATIVE_PARTS))
    if unknown:
        raise ValueError(f"{SWITCH}={value}: {unknown[0]!r} is not a native kernel (name some of "
                         f"{','.join(NATIVE_PARTS)}, or on / off)")
    return tuple(part for part in NATIVE_PARTS if part in named)


def machine_reason(part: str, flag: str, feature: str) -> str | None:
    """Why the native kernel `part` (of NATIVE_PARTS) cannot be built on this machine, whatever its shape:
    $PIPELINE_NATIVE leaving it out, the CPU lacking `flag` (as /proc/cpuinfo names it; `feature` in words),
    or no C compiler."""
    if part not in native_parts():
        return f"{SWITCH}={os.environ[SWITCH]} leaves out the native {part}"
    if flag not in cpu_identity().split():
        return f"this CPU has no {feature}"
    if c_compiler() is None:
        return "no C compiler ($CC, gcc or cc) is installed"
    return None


def loaded_library(source: Path, part: str, flag: str, feature: str, available: str) -> ctypes.CDLL | str:
    """The library of `source` (the native kernel `part`) built for this machine and loaded, or why not: the
    machine (`machine_reason`), the build, or the library's own `available()` entry returning 0 (the
    compiler left out the code for `feature`)."""
    why_not = machine_reason(part, flag, feature)
    if why_not:
        return why_not
    compiler = c_compiler()
    try:
        library = ctypes.CDLL(str(built_library(compiler, source)))
    except (OSError, subprocess.SubprocessError) as e:
        return f"building or loading {source.name} failed: {e}"
    if not getattr(library, available)():
        return f"{compiler} built {source.name} without {feature} (flags: {shlex.join(build_flags())})"
    return library


def function_address(function: ctypes._CFuncPtr) -> int:
    """The entry point of a loaded library's function, for C code that takes it as a function pointer."""
    return ctypes.cast(function, ctypes.c_void_p).value


def cache_dir() -> Path:
    return Path(os.environ.get("PIPELINE_KERNEL_CACHE") or Path.home() / ".cache" / "pipeline" / "kernels")


def built_library(compiler: str, source: Path, defines: tuple[str, ...] = ()) -> Path:
    """The shared library of `source` built with `defines`: found in the cache, else compiled into it.
    Raises OSError (with the compiler's messages) or subprocess.SubprocessError where the build fails."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    options = (*build_flags(), *defines)
    key = hashlib.sha256("\n".join([source_text(source), compiler, version, *options,
                                    cpu_identity()]).encode()).hexdigest()[:20]
    library = cache_dir() / f"{source.stem}-{key}.so"
    if not library.exists():
        _build(compiler, source, options, library)
    return library


def source_text(source: Path) -> str:
    """The source with the text of every local header it includes (`#include "name.h"`, next to it), so
    that a header's change rebuilds the libraries built from it."""
    text = source.read_text()
    headers = re.findall(r'^#include "([^"]+)"', text, flags=re.MULTILINE)
    return "\n".join([text, *((source.parent / name).read_text() for name in headers)])


def _build(compiler: str, source: Path, options: tuple[str, ...], library: Path) -> None:
    """Compile to a temporary name, then rename: concurrent jobs sharing the cache never see half a file."""
    library.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *options, str(source), "-o", tmp, "-lm"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(f"{compiler} failed on {source.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
