"""skillcache and vLLM: the head pool both sides map (heads.py), the connector vLLM loads (connector.py, imports vllm),
and the client skillcache talks to vLLM with (client.py). Nothing here is imported by the service at start-up unless
SKILLCACHE_ENGINE=vllm."""
