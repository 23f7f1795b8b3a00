"""The evidence study: suites of ordinary train.py runs (a base config plus each variant's overrides,
several seeds), and the reports that read them back (docs/study/README.md).

    runs.py          suites, run folders, training them --jobs at a time, reading their results
    stats.py         means, spreads and paired differences over seeds
    protocol.py      a group's references (matched baseline, own k = 1-only control) and FLOPs-matched runs
    switch_report.py the late-switch table: every run against both references and its own k = 1, seed by seed
    text_report.py   the text suite: loss per k against the paper's tables, per-loop statistics
    paper.py         the paper's side of the text suite: its losses, its claims, the readings it leaves open
    depth_report.py  the depth suite: answer accuracy per difficulty and k, extrapolation past K
    byte_data.py     the bundled prose re-encoded as bytes (the text suite's data)

Not part of the installed package: scripts/study.py imports it as `study_tools`, the tests as
`scripts.study_tools`; it imports the library, never the reverse.
"""
