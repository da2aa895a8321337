"""Entry point for vLLM: ``kv_connector_module_path: kvoffload.vllm``."""

from kvoffload.adapters.vllm.connector import KVOffloadConnector

__all__ = ["KVOffloadConnector"]
