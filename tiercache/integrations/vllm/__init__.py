"""tiercache as a vLLM KV connector.

Load it with KVTransferConfig(kv_connector="TierCacheConnector",
kv_connector_module_path="tiercache.integrations.vllm.connector", kv_role="kv_both",
kv_connector_extra_config={"socket": "/run/tiercache/tiercache.sock"}). Only connector.py imports
vLLM; the other modules are plain Python so they are tested without it.
"""
