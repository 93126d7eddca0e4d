"""The `kvshare bench` harness: kvshare vs transformers, sharing on/off, context scaling, bandwidth.

Modules: `sizes` (presets and benchmark configs), `measure` (clocks, peak memory, copy bandwidth),
`gen` (timed generation record), `kv_runner` (kvshare engine side), `hf_peer` (transformers side),
`dense` (dense-attention baseline), one module per section (`peer`, `sharing`, `context`,
`bandwidth`), `report` (tables, JSON, markdown, plots) and `suite` (runs them in one process).
"""
