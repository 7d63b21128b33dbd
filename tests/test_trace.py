"""Hash-only trace capture: rotation, privacy, the store's trace_path, and the simulator reading captures."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from tierkv import TieredStore, chunk_keys
from tierkv.errors import ConfigError
from tierkv.tools.sim import read_trace, simulate
from tierkv.trace import TraceWriter


def test_rotation_keeps_at_most_max_files_in_order(tmp_path):
    path = tmp_path / "cap" / "trace.jsonl"
    w = TraceWriter(str(path), max_bytes=2000, max_files=3, block_tokens=32)
    for i in range(200):
        w.record([f"req{i}-{j}".encode() for j in range(3)], input_length=90, output_length=i)
    w.close()
    files = w.files()
    assert [os.path.basename(f) for f in files] == ["trace.jsonl.2", "trace.jsonl.1", "trace.jsonl"]
    assert w.rotations > 2
    for f in files:
        lines = open(f).read().splitlines()
        assert json.loads(lines[0])["format"] == "tierkv-trace"  # every file starts with its header
        assert os.path.getsize(f) <= 2000 + 200
    reqs = list(read_trace(str(path.parent)))  # the directory, oldest file first
    outs = [r.output_length for r in reqs]
    assert outs == sorted(outs) and outs[-1] == 199 and len(outs) < 200  # the oldest were rotated away
    assert all(r.block_tokens == 32 and r.input_length == 90 and len(r.hash_ids) == 3 for r in reqs)


def test_ids_are_keyed_digests_and_no_token_or_hash_leaves(tmp_path):
    tokens = list(range(5000, 5000 + 64 * 4))
    keys = chunk_keys(tokens, 64, "model")
    w = TraceWriter(str(tmp_path / "t.jsonl"))
    w.record(keys)
    w.record(keys[:2])
    other = TraceWriter(str(tmp_path / "o.jsonl"), salt="another-deployment")
    other.record(keys)
    w.close()
    other.close()
    text = (tmp_path / "t.jsonl").read_text()
    for k in keys:
        assert k not in text and k[:16] not in text
    assert "5000" not in text.split("\n", 1)[1]
    a, b = list(read_trace(str(tmp_path / "t.jsonl")))
    assert b.hash_ids == a.hash_ids[:2] and len(set(a.hash_ids)) == 4  # equal prefixes, equal ids
    (c,) = read_trace(str(tmp_path / "o.jsonl"))
    assert not set(c.hash_ids) & set(a.hash_ids)  # another salt, unrelated ids
    assert all(0 <= h < 2**63 for h in a.hash_ids)


def test_store_trace_path_records_lookups_and_replays(tmp_path):
    cfg = {"tiers": [{"medium": "dram", "capacity": "1MiB"}], "trace_path": str(tmp_path / "tr" / "store.jsonl"),
           "trace": {"block_tokens": 64, "max_bytes": "1MiB"}}
    store = TieredStore.from_config(cfg)
    x = torch.zeros(1024, dtype=torch.uint8)
    prompts = [list(range(64 * 5)), list(range(64 * 3)) + [7] * 64, list(range(64 * 5))]
    for p in prompts:  # as an engine does: lookup, load the hits, store the rest
        keys = chunk_keys(p, 64, "m")
        n = store.lookup(keys)
        store.get(keys[:n], [torch.empty_like(x) for _ in range(n)])
        store.put(keys[n:], [x] * (len(keys) - n))
    store.close()
    reqs = list(read_trace(str(tmp_path / "tr")))
    assert [len(r.hash_ids) for r in reqs] == [5, 4, 5]
    assert reqs[1].hash_ids[:3] == reqs[0].hash_ids[:3] and reqs[2].hash_ids == reqs[0].hash_ids
    res = simulate(reqs, {"tiers": [{"medium": "dram", "capacity": "1MiB"}]}, bytes_per_token=16)
    assert res.leading_hits == 3 + 5  # the second request shares 3 blocks, the third all 5
    for bad, msg in (({"trace": {"max_files": 2}}, "needs 'trace_path'"),
                     ({"trace_path": str(tmp_path / "x"), "trace": {"rotate": 1}}, "unknown option"),
                     ({"trace_path": str(tmp_path / "x"), "trace": {"max_files": 0}}, "at least 1"),
                     ({"trace_path": 5}, "expected a string")):
        with pytest.raises(ConfigError, match=msg):
            TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "1MiB"}], **bad})


def test_a_write_failure_disables_the_trace_not_the_store(tmp_path):
    store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "1MiB"}],
                                     "trace_path": str(tmp_path / "t.jsonl")})
    tracer = store._observers.attached[0]

    class FullDisk:
        def write(self, s):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            pass

    tracer.writer._f = FullDisk()
    assert store.lookup(["a", "b"]) == 0
    assert "No space left" in tracer.writer.failed
    assert store.lookup(["a"]) == 0 and tracer.writer.records == 0
    store.close()


def test_connector_traces_carry_the_block_bytes(tmp_path):
    from types import SimpleNamespace

    from tierkv.adapters.vllm.trace_hook import RequestTracer

    path = tmp_path / "vllm.jsonl"
    tracer = RequestTracer.from_extra_config({"trace_path": str(path)}, 16, block_bytes=16 * 4096)
    assert tracer is not None
    tracer.on_lookup(SimpleNamespace(request_id="r1", block_hashes=[b"a" * 32, b"b" * 32], num_prompt_tokens=30,
                                     max_tokens=4))
    tracer.close()
    header, rec = (json.loads(x) for x in path.read_text().splitlines())
    assert header["block_bytes"] == rec["block_bytes"] == 16 * 4096
    (req,) = read_trace(str(path))
    assert req.block_bytes == 16 * 4096 and req.block_tokens == 16
