"""The vLLM KV connector (``kv_connector_module_path: kvoffload.vllm``)."""
