"""The tiercache daemon: create_server(config) and serve(config) over a TieredStore (imports the core,
never the reverse)."""
