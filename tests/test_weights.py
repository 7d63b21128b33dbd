"""``tierkv.weights``: a digest of the weights an engine loads, from their content, cheap at start-up."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest

from adapters.vllm.config import model_key
from tierkv import weights as W
from tierkv.weights import resolve_weights, sample_offsets, weights_identity

SHARD = 4 << 20  # larger than the sampled blocks together: read by samples


def _checkpoint(path, seed: int = 0):
    rng = __import__("random").Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "llama", "hidden_size": 128}')
    for i in range(2):
        (path / f"model-0000{i}-of-00002.safetensors").write_bytes(rng.randbytes(SHARD))
    (path / "README.md").write_text("not a weight file")
    return path


def _poke(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_the_digest_is_short_hex_and_stable_across_calls_and_processes(tmp_path):
    ck = _checkpoint(tmp_path / "m")
    d = weights_identity(str(ck))
    assert len(d) == W.DIGEST_CHARS and int(d, 16) >= 0
    assert weights_identity(str(ck)) == d
    code = "import sys; from tierkv.weights import weights_identity; print(weights_identity(sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", code, str(ck)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "123"})
    assert out.stdout.strip() == d
    ident = resolve_weights(str(ck))
    assert ident.verified and ident.source == "files" and d in ident.describe()


def test_content_decides_not_the_path_nor_the_mtimes(tmp_path):
    ck = _checkpoint(tmp_path / "a")
    copy = tmp_path / "elsewhere" / "b"
    shutil.copytree(ck, copy)
    for f in copy.iterdir():
        os.utime(f, (1, 1))
    assert weights_identity(str(copy)) == weights_identity(str(ck))
    # files the engine does not load as weights are not read
    (copy / "README.md").write_text("edited")
    (copy / "notes.txt").write_text("new")
    assert weights_identity(str(copy)) == weights_identity(str(ck))


@pytest.mark.parametrize("where", ["head", "tail", "middle sample"])
def test_a_change_in_a_sampled_block_changes_the_digest(tmp_path, where):
    ck = _checkpoint(tmp_path / "m")
    before = weights_identity(str(ck))
    offsets = sample_offsets(SHARD)
    assert len(offsets) == W.SAMPLES and offsets[0] == 0 and offsets[-1] == SHARD - W.SAMPLE_BYTES
    at = {"head": 10, "tail": SHARD - 1, "middle sample": offsets[W.SAMPLES // 2] + 100}[where]
    _poke(ck / "model-00001-of-00002.safetensors", at)
    assert weights_identity(str(ck)) != before


def test_other_weights_of_the_same_shape_size_or_config_change_it(tmp_path):
    ck = _checkpoint(tmp_path / "m")
    before = weights_identity(str(ck))
    assert weights_identity(str(_checkpoint(tmp_path / "other", seed=1))) != before  # same names and sizes
    with open(ck / "model-00000-of-00002.safetensors", "ab") as f:  # one more byte
        f.write(b"\0")
    grown = weights_identity(str(ck))
    assert grown != before
    (ck / "config.json").write_text('{"model_type": "llama", "hidden_size": 256}')
    assert weights_identity(str(ck)) != grown
    (ck / "extra.bin").write_bytes(b"x")  # a weight file more
    assert len({before, grown, weights_identity(str(ck))}) == 3


def test_small_files_are_hashed_whole(tmp_path):
    ck = tmp_path / "m"
    ck.mkdir()
    (ck / "model.safetensors").write_bytes(bytes(W.SAMPLES * W.SAMPLE_BYTES))
    before = resolve_weights(str(ck))
    assert sample_offsets(W.SAMPLES * W.SAMPLE_BYTES) == []
    _poke(ck / "model.safetensors", W.SAMPLE_BYTES + 7)  # between where samples of a larger file would be
    assert weights_identity(str(ck)) != before.digest


def test_a_single_weight_file_is_a_model_too(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(os.urandom(SHARD))
    d = weights_identity(str(f))
    assert resolve_weights(str(f)).detail.startswith("1 files")
    _poke(f, 0)
    assert weights_identity(str(f)) != d


def test_lora_adapters_are_mixed_in_in_order(tmp_path):
    ck = str(_checkpoint(tmp_path / "m"))
    a, b = tmp_path / "lora_a", tmp_path / "lora_b"
    for p, seed in ((a, 1), (b, 2)):
        p.mkdir()
        (p / "adapter_config.json").write_text('{"r": 8}')
        (p / "adapter_model.safetensors").write_bytes(__import__("random").Random(seed).randbytes(1 << 16))
    base = weights_identity(ck)
    with_a = weights_identity(ck, lora_paths=[str(a)])
    assert len({base, with_a, weights_identity(ck, lora_paths=[str(b)])}) == 3
    assert weights_identity(ck, lora_paths=str(a)) == with_a  # one path as a string
    assert weights_identity(ck, lora_paths=[str(a), str(b)]) != weights_identity(ck, lora_paths=[str(b), str(a)])
    _poke(a / "adapter_model.safetensors", 5)
    assert weights_identity(ck, lora_paths=[str(a)]) != with_a


def _hub(cache, name: str, ref: str, commit: str) -> None:
    repo = cache / ("models--" + name.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True, exist_ok=True)


def test_a_hub_name_is_the_commit_its_revision_resolves_to(tmp_path):
    cache = tmp_path / "hub"
    c1, c2 = "1" * 40, "2" * 40
    _hub(cache, "org/model", "main", c1)
    ident = resolve_weights("org/model", download_dir=str(cache))
    assert ident.verified and ident.source == "hub-cache" and c1 in ident.detail
    assert weights_identity("org/model", revision="main", download_dir=str(cache)) == ident.digest
    assert weights_identity("org/model", revision=c1, download_dir=str(cache)) == ident.digest  # pinned
    _hub(cache, "org/model", "main", c2)  # the branch moved
    assert weights_identity("org/model", download_dir=str(cache)) != ident.digest

    class Resolved(str):  # what huggingface_hub's resolve_revision returns: "main", carrying its commit
        resolved = c1

    assert weights_identity("org/model", revision=Resolved("main"), download_dir=str(cache)) == ident.digest


def test_a_name_that_cannot_be_resolved_is_unverified_counted_and_logged(tmp_path, caplog):
    n = W.unverified_count()
    with caplog.at_level(logging.WARNING, logger="tierkv.weights"):
        ident = resolve_weights("org/absent", revision="v2", download_dir=str(tmp_path))
    assert not ident.verified and ident.source == "name"
    assert ident.describe().startswith(W.UNVERIFIED)
    assert W.unverified_count() == n + 1
    assert "cannot be verified" in caplog.text
    # deterministic still: every engine given that name shares the same (unverified) root
    assert weights_identity("org/absent", revision="v2", download_dir=str(tmp_path)) == ident.digest
    assert weights_identity("org/absent", revision="v3", download_dir=str(tmp_path)) != ident.digest


def test_bad_model_argument_is_a_clear_error():
    with pytest.raises(ValueError, match="model"):
        weights_identity("")


def test_model_key_of_the_vllm_connector(tmp_path):
    ck = str(_checkpoint(tmp_path / "m"))
    key, how = model_key(ck)
    assert key == "weights:" + weights_identity(ck) and "files" in how
    # the path is not part of it: the same checkpoint elsewhere has the same key
    shutil.copytree(ck, tmp_path / "copy")
    assert model_key(str(tmp_path / "copy"))[0] == key
    # model_id asserts the weights: nothing is read, the name is the key
    key, how = model_key(str(tmp_path / "nowhere"), model_id="tiny-v1", namespace="team")
    assert key == "tiny-v1#ns:team" and "asserted" in how
    # unverified: the name and revision, as keys were before
    key, how = model_key("org/absent", "v2", str(tmp_path))
    assert key == "org/absent@v2" and how.startswith(W.UNVERIFIED)
