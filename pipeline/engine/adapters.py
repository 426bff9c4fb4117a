"""Which LoRA adapters a run may use, and which of them are resident on the model.

A request names an adapter (`Request.adapter`): a name of the configured mapping (`LoraConfig.adapters`,
the job's `model.lora.adapters`) or else a folder path or fsspec URL of a PEFT checkpoint. Each adapter is
read and checked against the model once (`resolve`); a problem is the request's error, never the run's.

At most `max_loaded` adapters are resident (the model's LoRA slots). A sample takes its adapter's slot when
the scheduler admits it and lets go when it finishes or is preempted; an adapter not resident is loaded into
a free slot, else into the least recently used slot that no running sample holds. When every slot is held,
admission waits for one to free (a running sample always finishes, so it never waits forever).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.engine.sequence import Sequence
from pipeline.model.config import ModelConfig
from pipeline.model.lora.peft_file import AdapterError, read_adapter
from pipeline.model.remote import cached_model, is_url

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraConfig:
    """The adapters of a run: `adapters` maps names to folders or fsspec URLs (a request may also give a
    folder or URL itself); `max_loaded` adapters are resident at once; remote ones are copied into
    `cache_dir` (None: the model cache, `pipeline.model.remote`)."""

    adapters: Mapping[str, str] = field(default_factory=dict)
    max_loaded: int = 8
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_loaded, int) or isinstance(self.max_loaded, bool) or self.max_loaded < 1:
            raise ValueError(f"model.lora.max_loaded must be an integer >= 1, got {self.max_loaded!r}")
        bad = {k: v for k, v in self.adapters.items() if not (isinstance(k, str) and k and isinstance(v, str) and v)}
        if bad:
            raise ValueError(f"model.lora.adapters must map names to folders or URLs, got {bad!r}")


def adapter_folder(source: str, cache_dir: str | None = None) -> Path:
    """The local folder of an adapter `source`: the folder itself, or the cached copy of an fsspec URL."""
    if is_url(source):
        try:
            return cached_model(source, cache_dir)[0]
        except FileNotFoundError as e:
            raise AdapterError(str(e).replace("model.path", "adapter")) from None
        except OSError as e:
            raise AdapterError(f"cannot copy adapter {source!r} into the local cache: {e}") from None
    return Path(source.split("://", 1)[-1])


def check_adapter(name: str, source: str, model: ModelConfig, cache_dir: str | None = None) -> Path:
    """The local folder of adapter `name` (at `source`) once it is read and checked against `model`;
    AdapterError otherwise."""
    folder = adapter_folder(source, cache_dir)
    if not folder.is_dir():
        raise AdapterError(f"adapter {name!r}: {source} is not a folder")
    adapter = read_adapter(folder, model, name)
    log.info("LoRA adapter %r (%s): rank %d, scale %.4g, on %s", name, folder, adapter.rank, adapter.scale,
             ", ".join(adapter.targets))
    return folder


class AdapterManager:
    """Resolves requests' adapters and keeps the resident ones in the model's slots. `load(slot, folder,
    slots)` places an adapter (the runner's, which also tells tensor-parallel workers)."""

    def __init__(self, config: LoraConfig, model: ModelConfig, load: Callable[[int, str, int], None]):
        self.config = config
        self.model = model
        self.load = load
        self._folders: dict[str, Path | AdapterError] = {}  # key -> checked folder, or why it cannot run
        self._slot_of: dict[str, int] = {}
        self._lru: OrderedDict[int, str] = OrderedDict()  # resident slot -> key, least recently used first
        self._holders = [0] * config.max_loaded  # running samples per slot
        self.loads = 0
        self.evictions = 0

    def resolve(self, value: str) -> str:
        """The key a request's adapter `value` runs under (itself), once it is known to run here;
        AdapterError naming the problem otherwise."""
        if value not in self._folders:
            source = self.config.adapters.get(value)
            try:
                if source is None and not adapter_folder(value, self.config.cache_dir).is_dir():
                    names = ", ".join(sorted(self.config.adapters)) or "none"
                    raise AdapterError(f"unknown adapter {value!r}: not a name in model.lora.adapters ({names}) "
                                       "nor a folder")
                self._folders[value] = check_adapter(value, source or value, self.model, self.config.cache_dir)
            except AdapterError as e:
                self._folders[value] = e
        found = self._folders[value]
        if isinstance(found, AdapterError):
            raise found
        return value

    def preload(self) -> None:
        """Load the configured adapters (`model.lora.adapters`, in order, as many as there are slots) before any
        row asks: the first steps then run at once rather than reading files, and the job counts the reads in
        its load. A slot filled here is evictable like any other; an adapter that cannot run is left to its
        rows' errors."""
        for name in list(self.config.adapters)[: self.config.max_loaded]:
            try:
                self.resolve(name)
            except AdapterError:
                continue
            slot = self._free_slot()
            self.load(slot, str(self._folders[name]), self.config.max_loaded)
            self.loads += 1
            self._slot_of[name] = slot
            self._lru[slot] = name

    def acquire(self, seq: Sequence) -> bool:
        """Give seq its adapter's slot (loading the adapter where needed); False when every slot is held."""
        if seq.adapter is None:
            return True
        slot = self._slot_of.get(seq.adapter)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            self.load(slot, str(self._folders[seq.adapter]), self.config.max_loaded)
            self.loads += 1
            self._slot_of[seq.adapter] = slot
        self._lru[slot] = seq.adapter
        self._lru.move_to_end(slot)
        self._holders[slot] += 1
        seq.lora_slot = slot
        return True

    def release(self, seq: Sequence) -> None:
        """seq no longer runs: its slot may be reused once no other sample holds it."""
        if seq.lora_slot >= 0:
            self._holders[seq.lora_slot] -= 1
            seq.lora_slot = -1

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used one nobody holds (its adapter evicted), else None."""
        empty = next((s for s in range(self.config.max_loaded) if s not in self._lru), None)
        if empty is not None:
            return empty
        slot = next((s for s in self._lru if not self._holders[s]), None)
        if slot is not None:
            del self._slot_of[self._lru.pop(slot)]
            self.evictions += 1
        return slot
