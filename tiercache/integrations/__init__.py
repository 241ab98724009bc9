"""Engine connectors: tiercache as the KV cache of other inference engines (vLLM)."""
