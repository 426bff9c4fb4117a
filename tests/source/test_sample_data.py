"""data/sample is what data/make_sample.py writes, and has the mix docs/running.md promises ("Sample data")."""

from __future__ import annotations

import runpy
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "sample"


def test_script_rebuilds_the_committed_shards(tmp_path):
    runpy.run_path(str(SAMPLE.parent / "make_sample.py"))["main"](str(tmp_path))
    names = sorted(p.name for p in SAMPLE.glob("*.parquet"))
    assert names == sorted(p.name for p in tmp_path.glob("*.parquet")) and len(names) == 3
    for name in names:
        assert pq.read_table(tmp_path / name).equals(pq.read_table(SAMPLE / name))


def test_sample_mix():
    df = pl.read_parquet(SAMPLE / "*.parquet")
    assert len(df) == 200 and df["id"].n_unique() == 200
    first_turns = df["messages"].list.first().struct.field("content")
    systems = df["messages"].list.first().struct.field("role") == "system"
    assert 0 < systems.sum() < len(df)  # some conversations without a system turn
    assert first_turns.filter(systems).n_unique() == 4  # four shared system prompts
    assert (df["messages"].list.len() > 2).sum() > 10  # multi-turn conversations
    assert df["prompt"].str.len_chars().min() > 0
