"""The SGLang adapter's pure parts, which run without SGLang; its rows join the matrix (tests/test_matrix.py)
where the extra is installed (bash ci/install-sglang.sh) and are listed as unavailable, with why, elsewhere."""

from __future__ import annotations

import pytest

from backends.registry import CompositionError, all_compositions, parse
from backends.sglang import runtime
from backends.sglang.adapter import retrieve_links


def test_retrieve_links_follow_the_tree():
    # root 0 with children 1 and 2; 3 is a child of 1
    first_child, next_sibling = retrieve_links([-1, 0, 0, 1])
    assert first_child == [1, 3, -1, -1]
    assert next_sibling == [-1, 2, -1, -1]
    assert retrieve_links([-1, 0, 1]) == ([1, 2, -1], [-1, -1, -1])  # a chain has no siblings


def test_sglang_terms_are_sglangs_own_classes_only():
    assert str(parse("sglang.triton")) == "sglang.triton"
    assert parse("tbo(sglang.triton)").engine == "sglang"  # SGLang's TboAttnBackend, not the harness's
    with pytest.raises(CompositionError, match="cannot mix"):
        parse("hybrid(sglang.triton,linear_torch)")
    with pytest.raises(CompositionError, match="not adapted yet"):
        parse("graph(sglang.triton)")
    assert parse("tbo(hybrid(sglang.triton,sglang.gdn))").engine == "sglang"
    terms = {str(c) for c in all_compositions()}
    assert {"sglang.torch_native", "sglang.triton", "tbo(sglang.triton)", "tbo(sglang.torch_native)",
            "hybrid(sglang.triton,sglang.gdn)", "tbo(hybrid(sglang.triton,sglang.gdn))"} <= terms
    assert "sglang.gdn" not in terms  # SGLang builds its GDN backend inside its hybrid wrapper only
    assert not any("sglang" in t and t.startswith("graph") for t in terms)


def test_unavailable_reason_names_the_install_command_or_the_version(monkeypatch):
    monkeypatch.setattr(runtime, "installed_version", lambda: None)
    assert runtime.INSTALL_HINT in runtime.unavailable_reason()
    monkeypatch.setattr(runtime, "installed_version", lambda: "0.4.0")
    monkeypatch.setattr(runtime.importlib.util, "find_spec", lambda name: object())
    assert runtime.unavailable_reason() == "sglang 0.4.0 is installed; the adapter supports 0.5.23"
