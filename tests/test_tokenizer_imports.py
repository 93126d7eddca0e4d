"""Issue 34's import rules for the tokenizer: it renders no tool syntax (that is the server's,
`server/tool_calls.DSML_FORMAT`, passed in as a `ToolFormat`) and reads no model config (a byte
tokenizer is sized from the config's JSON fields)."""

from __future__ import annotations

from test_import_graph import import_graph


def test_tokenizer_imports_neither_the_server_nor_the_config() -> None:
    deps = import_graph()["kvshare.tokenizer"]
    assert not {d for d in deps if d.startswith(("kvshare.server", "kvshare.config"))}, deps
