"""The startup cache (`pipeline.model.startup_cache`): entries built once, read back, rebuilt when damaged,
shared safely by concurrent jobs; a quantized model read from it is the model a fresh load builds."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash

from pipeline.model import loader, quant, startup_cache, w8a8_gemm
from pipeline.model.loader import load_model
from pipeline.model.startup_cache import JSON_ENTRY, StartupCache

REPO = Path(__file__).resolve().parents[2]


def counted(value, calls: list):
    def build():
        calls.append(1)
        return value

    return build


def test_an_entry_is_built_once_then_read(tmp_path):
    cache, calls = StartupCache(tmp_path), []
    name = cache.key("figures", size=3)
    assert cache.fetch(name, counted({"a": [1, 2]}, calls), *JSON_ENTRY) == {"a": [1, 2]}
    assert StartupCache(tmp_path).fetch(name, counted({"a": "other"}, calls), *JSON_ENTRY) == {"a": [1, 2]}
    assert len(calls) == 1
    assert cache.key("figures", size=4) != name  # the key follows what the value depends on


@pytest.mark.parametrize("damage", ["truncated", "a byte changed", "seal missing", "decodes badly"])
def test_a_damaged_entry_is_rebuilt_not_trusted(tmp_path, caplog, damage):
    cache, calls = StartupCache(tmp_path), []
    name = cache.key("figures")
    cache.fetch(name, counted(list(range(100)), calls), *JSON_ENTRY)
    payload, seal = tmp_path / name, tmp_path / f"{name}.seal"
    data = payload.read_bytes()
    if damage == "truncated":
        payload.write_bytes(data[: len(data) // 2])
    elif damage == "a byte changed":
        payload.write_bytes(data.replace(b"7", b"8", 1))
    elif damage == "seal missing":
        seal.unlink()
    else:  # hashes right (the seal rewritten to match) but is not what `load` reads
        payload.write_bytes(b"not json")
        cache._write(name, None, lambda value, f: f.write(b"not json"))
    with caplog.at_level(logging.WARNING):
        assert cache.fetch(name, counted(list(range(100)), calls), *JSON_ENTRY) == list(range(100))
    assert len(calls) == 2
    assert (damage == "seal missing") or "is damaged" in caplog.text
    assert json.loads(payload.read_bytes()) == list(range(100))  # rewritten whole
    assert cache.fetch(name, counted([], calls), *JSON_ENTRY) == list(range(100)) and len(calls) == 2


def test_four_concurrent_jobs_build_an_entry_once_and_all_read_it(tmp_path):
    """Each process asks for the same entry; the build (slow, and logging each call to a file) runs in
    exactly one of them, whichever order they come in, and every process gets its value."""
    script = f"""
import sys, time
sys.path.insert(0, {str(REPO)!r})
from pipeline.model.startup_cache import JSON_ENTRY, StartupCache

def build():
    with open({str(tmp_path / 'builds')!r}, "a") as f:
        f.write("built\\n")
    time.sleep(0.5)
    return {{"figures": list(range(1000))}}

cache = StartupCache({str(tmp_path / 'cache')!r})
value = cache.fetch(cache.key("shared"), build, *JSON_ENTRY)
print(sum(value["figures"]))
"""
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0] * 4
    assert outputs == [str(sum(range(1000)))] * 4
    assert (tmp_path / "builds").read_text() == "built\n"


def test_an_unwritable_folder_computes_without_the_cache(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache, calls = StartupCache(blocker / "cache"), []
    with caplog.at_level(logging.WARNING):
        assert cache.fetch("x", counted(5, calls), *JSON_ENTRY) == 5
        assert cache.fetch("x", counted(5, calls), *JSON_ENTRY) == 5
    assert len(calls) == 2 and "not writable" in caplog.text


def test_a_module_entry_that_cannot_be_written_is_skipped_not_fatal(tmp_path, caplog, monkeypatch):
    """torch.save reports a full disk as a RuntimeError: the job goes on with the model it built, and no
    part of the entry is left for a later start to read."""
    def full_disk(obj, f):
        f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing "
                           "file data/0: file write failed; unexpected pos 64 vs 128")

    monkeypatch.setattr(startup_cache.torch, "save", full_disk)
    module, calls = torch.nn.Linear(2, 2), []

    def build() -> torch.nn.Module:
        calls.append(1)
        return module

    cache = StartupCache(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert cache.fetch("m", build, *startup_cache.MODULE_ENTRY) is module
    assert "cannot write startup cache entry" in caplog.text and "unexpected pos" in caplog.text
    assert not [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")]
    monkeypatch.undo()
    assert isinstance(cache.fetch("m", build, *startup_cache.MODULE_ENTRY), torch.nn.Linear) and len(calls) == 2


def test_the_file_hash_is_the_contents_and_follows_a_changed_file(tmp_path):
    cache = StartupCache(tmp_path / "cache")
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"weights" * 1000)
    b.write_bytes(b"weights" * 1000)
    assert cache.file_hash(a) == cache.file_hash(b)  # same bytes, other path: the same key
    first = cache.file_hash(a)
    a.write_bytes(b"weightz" * 1000)
    assert cache.file_hash(a) != first


@pytest.mark.parametrize("entry", ["module", "json"])
def test_the_seal_hashed_while_writing_is_that_of_the_bytes_on_disk(tmp_path, entry):
    """The seal comes from the bytes as they were written, not from reading the file back: it must be
    the size and xxh3-128 of the file as it lies on disk, or every read would find the entry damaged."""
    cache = StartupCache(tmp_path)
    value, kind = ((torch.nn.Linear(300, 200), startup_cache.MODULE_ENTRY) if entry == "module"
                   else ({"a": list(range(1000))}, JSON_ENTRY))
    name = cache.key(entry)
    cache.fetch(name, lambda: value, *kind)
    payload = (tmp_path / name).read_bytes()
    assert (tmp_path / f"{name}.seal").read_text().split() == [str(len(payload)),
                                                               xxhash.xxh3_128(payload).hexdigest()]


def _hidden_states(model: torch.nn.Module) -> torch.Tensor:
    from pipeline.model.attention import WholeSequence

    ids = torch.tensor([1, 5, 9, 200, 3, 77, 12, 40])
    with torch.inference_mode():
        return model(ids, torch.arange(len(ids)), WholeSequence(model.scale))


@pytest.mark.parametrize("scheme,rows", [("w8a8", None), ("int4", 4)])
def test_a_model_read_from_the_cache_is_the_model_a_load_builds(tmp_path, tiny_model_dir, monkeypatch, scheme, rows):
    """The second load reads the quantized model and its GEMM choice (no calibration, no timing) and gives
    the first load's hidden states bit for bit; a truncated entry is rebuilt."""
    monkeypatch.setattr(startup_cache, "cpus_busy", lambda: False)  # a quiet machine: no timing is redone
    cache = StartupCache(tmp_path)
    options = {"quant": scheme, "w8a8_rows": rows, "prefer_speed": True, "startup_cache": cache}
    first = load_model(tiny_model_dir, **options)
    assert first.cache_key is not None and (tmp_path / first.cache_key).is_file()
    expected = _hidden_states(first.model)

    def refuse(*args, **kwargs):
        raise AssertionError("a cached start must not quantize or time anything")

    with monkeypatch.context() as patch:
        patch.setattr(loader, "load_quantized", refuse)
        patch.setattr(w8a8_gemm, "alternating_best", refuse)
        second = load_model(tiny_model_dir, **options)
    assert second.cache_key == first.cache_key
    assert second.model.kernel_choice.int8_gemm == first.model.kernel_choice.int8_gemm
    assert second.model.kernel_choice.w8a8_rows == first.model.kernel_choice.w8a8_rows
    assert torch.equal(_hidden_states(second.model), expected)

    entry = tmp_path / first.cache_key
    entry.write_bytes(entry.read_bytes()[:1000])
    calls = []
    original = quant.load_quantized
    monkeypatch.setattr(loader, "load_quantized", lambda *a, **k: calls.append(1) or original(*a, **k))
    third = load_model(tiny_model_dir, **options)
    assert calls == [1] and torch.equal(_hidden_states(third.model), expected)


def test_a_first_load_hashes_the_file_beside_the_build_and_keys_the_entry_by_its_bytes(tmp_path, tiny_model_dir,
                                                                                     monkeypatch):
    """With the file's hash not remembered, the load builds while the file is hashed and stores the entry
    under the key of the files' bytes (xxh3-128 of them in name order, computed here); with the hash
    forgotten again (a touched file), it builds once more, keys alike and leaves the stored entry as it is."""
    monkeypatch.setattr(startup_cache, "cpus_busy", lambda: False)
    cache = StartupCache(tmp_path)
    options = {"quant": "int4", "w8a8_rows": 4, "prefer_speed": True, "startup_cache": cache}
    first = load_model(tiny_model_dir, **options)
    digest = xxhash.xxh3_128()
    for path in sorted(p for p in Path(tiny_model_dir).resolve().rglob("*") if p.is_file()):
        digest.update(path.read_bytes())
    assert first.cache_key == cache.key("model", file=digest.hexdigest(), dtype="torch.float32", quant="int4",
                                        group=32, w8a8_rows=4, lm_head="int8", prefer_speed=True)
    entry = tmp_path / first.cache_key
    written = entry.stat().st_mtime_ns, entry.stat().st_ino
    for memo in tmp_path.glob("hash-*"):
        memo.unlink()
    calls = []
    original = quant.load_quantized
    monkeypatch.setattr(loader, "load_quantized", lambda *a, **k: calls.append(1) or original(*a, **k))
    again = load_model(tiny_model_dir, **options)
    assert calls == [1] and again.cache_key == first.cache_key
    assert (entry.stat().st_mtime_ns, entry.stat().st_ino) == written
    assert torch.equal(_hidden_states(again.model), _hidden_states(first.model))


def test_no_entry_for_a_load_with_nothing_slow_to_keep(tmp_path, tiny_model_dir):
    cache = StartupCache(tmp_path)
    assert load_model(tiny_model_dir, startup_cache=cache).cache_key is None  # the float model
    assert load_model(tiny_model_dir, quant="int8", startup_cache=cache).cache_key is None  # weight-only
    assert not any(tmp_path.iterdir())


def test_the_folder_keeps_the_entries_used_last_within_its_size(tmp_path):
    """Past `max_bytes` the entries used longest ago go first (a read counts as a use), never the one
    just written; what is left still reads back."""
    cache = StartupCache(tmp_path, max_bytes=3500)  # three entries of ~1,000 bytes fit
    names = [cache.key("figures", i=i) for i in range(3)]
    for age, name in enumerate(names):
        cache.fetch(name, lambda: "x" * 1000, *JSON_ENTRY)
        os.utime(tmp_path / f"{name}.seal", ns=(age * 10**9, age * 10**9))  # written in this order
    assert cache.fetch(names[0], lambda: "rebuilt", *JSON_ENTRY) == "x" * 1000  # read: now the latest used
    cache.max_bytes = 2100  # two fit
    cache.fetch(cache.key("figures", i=3), lambda: "y" * 1000, *JSON_ENTRY)
    left = {p.name for p in tmp_path.iterdir() if not p.name.endswith((".lock", ".seal"))}
    assert left == {names[0], cache.key("figures", i=3)}  # names[1] and names[2] were used longest ago
    assert cache.fetch(names[0], lambda: "rebuilt", *JSON_ENTRY) == "x" * 1000
    huge = StartupCache(tmp_path, max_bytes=10)
    assert huge.fetch(huge.key("big"), lambda: "z" * 100, *JSON_ENTRY) == "z" * 100  # kept though over budget
    assert (tmp_path / huge.key("big")).is_file()


def test_an_entry_is_read_where_its_use_cannot_be_recorded(tmp_path, monkeypatch):
    """A shared folder this job may read but not write: marking the entry used fails, the entry is still read."""
    cache, calls = StartupCache(tmp_path), []
    name = cache.key("figures")
    cache.fetch(name, counted([1], calls), *JSON_ENTRY)

    def refuse(self, *args, **kwargs):
        raise PermissionError(f"read-only: {self}")

    monkeypatch.setattr(Path, "touch", refuse)
    assert cache.fetch(name, counted([2], calls), *JSON_ENTRY) == [1] and len(calls) == 1


@pytest.mark.parametrize("busy_then,busy_now,timed_again", [
    (True, False, True),  # timed on a busy machine, now free: timed again
    (True, True, False),  # still busy: the busy figure serves
    (False, False, False),  # timed on a free machine: kept
    (False, True, False),
])
def test_a_timing_from_a_busy_machine_is_redone_once_it_is_free(tmp_path, monkeypatch, busy_then, busy_now,
                                                                 timed_again):
    cache, calls = StartupCache(tmp_path), []
    name = cache.key("timing")
    monkeypatch.setattr(startup_cache, "cpus_busy", lambda: busy_then)
    assert cache.fetch_timing(name, counted({"ms": 3.0}, calls)) == {"ms": 3.0}
    monkeypatch.setattr(startup_cache, "cpus_busy", lambda: busy_now)
    assert cache.fetch_timing(name, counted({"ms": 1.0}, calls)) == ({"ms": 1.0} if timed_again else {"ms": 3.0})
    assert len(calls) == 1 + timed_again
    # what is stored now is read back at the next start in the same state
    assert StartupCache(tmp_path).fetch_timing(name, counted({"ms": 9.0}, calls)) != {"ms": 9.0}


def test_busy_means_a_load_above_the_cpus_this_process_may_use(monkeypatch):
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "getloadavg", lambda: (cpus + 0.5, 0.0, 0.0))
    assert startup_cache.cpus_busy()
    monkeypatch.setattr(os, "getloadavg", lambda: (float(cpus), 0.0, 0.0))
    assert not startup_cache.cpus_busy()
