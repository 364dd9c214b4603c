"""`jaxoverlap profile`: run a workload with the overlap loop and with the normal loop,
capture a device trace of a few steps of each, and report per-step device time, the gap
between steps, the host's time per step and the throughput (the article's Figures 2, 3,
11 and 12).

    capture.py  runs the workload on an Engine, times it, captures the trace
    trace.py    reads the trace JSON: host launch spans, device ops, ops -> steps (pure Python)
    report.py   per-step statistics, profile.json, the printed table
    plots.py    the PNG figures (matplotlib, Agg)
    cli.py      the command's arguments and its main function
"""
