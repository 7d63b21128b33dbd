"""TierKVStorage's conformance without a server: built through SGLang's own backend factory on real SGLang host
pools (MHA in layer_first, page_first, page_first_direct and page_head; MLA), in the SGLang venv
(``tests/sglang_cpu/conformance.py``, one process for every check: SGLang's import is the slow part)."""

from __future__ import annotations

import pytest
from sglang_util import run_in_sglang

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

CHECKS = ["roundtrip_layer_first", "roundtrip_page_first", "roundtrip_page_first_direct", "roundtrip_page_head",
          "hole", "mla", "mla_page_first", "v2", "isolation", "corrupt_ssd", "faults", "leases"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sglang-conformance")
    return run_in_sglang(["tests/sglang_cpu/conformance.py", str(out), *CHECKS])


@pytest.mark.parametrize("check", CHECKS)
def test_conformance(results, check):
    """roundtrip_*: bit-exact v1 and generic round trips in each host layout; hole: leading hits stop at a hole;
    mla: the non-writer rank stores nothing and reads everything; isolation: dtype, layout, page size, TP rank,
    TP size and model never see each other's pages; corrupt_ssd: a corrupted SSD object is a miss; faults: a
    tier that raises is a miss on every path, counted, no exception; leases: exists leases what get reads;
    v2: a hybrid model's extra pool keyed under its own name, SGLang's all_pages and trailing_pages policies."""
    assert results.get(check) == "ok", results.get(check)
