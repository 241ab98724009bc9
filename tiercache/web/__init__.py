"""The status page: a read-only web page of the cache's tiers, namespaces and last requests.

board.py gathers the figures (the daemon reads its store, `tiercache api` asks its daemon) and keeps
an hour of them; static/ holds the page itself (plain HTML, CSS and JavaScript: no build step), which
reads status.json from wherever it is served: the daemon's metrics port or the HTTP API."""
