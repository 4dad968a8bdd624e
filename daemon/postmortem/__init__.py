"""The postmortem: several nodes' journals folded, merged and searched for anomalies.

``kvpushd journal replay|timeline|report``. Its modules, in the order data
flows through them:

- ``vocab.py``: event kinds, states and roles as small integer codes;
- ``sources.py``: the inputs (directories, copied segment files) grouped by node;
- ``fold.py``: one node's journal folded through the core, kept as columns;
- ``progress.py``: the progress bar, fed by worker processes;
- ``load.py``: every node read and folded, in parallel processes when it pays;
- ``clocks.py``: clock offsets between nodes, from the messages they exchanged;
- ``merge.py``: every node's steps in one view of requests, on one clock;
- ``filters.py``: ``--request``, ``--since``, ``--state``, ... and the selection;
- ``analyse.py``: final states, refusals, anomalies and latency of the selection;
- ``timeline.py``: one request's life across nodes, step by step;
- ``formatting.py``, ``text.py``, ``render_json.py``: the text and JSON output;
- ``chart.py``, ``html.py``, ``html_assets.py``: the self-contained HTML report;
- ``commands.py``: the commands' options, and the pipeline from paths to output.
"""
