"""skillcache and vLLM: composition runs inside vLLM, skillcache plans it. The plan of a composed head (chain.py:
which tokens are copied from saved spans, which vLLM computes, in what steps) and what a request asks of the connector
(transfer.py); the connector vLLM loads (connector.py, imports vllm; what it plans per step: connector_meta.py;
what differs between the vLLM releases it is tested on: compat.py), which saves the spans vLLM computed (compiled
blocks, composition steps) in the spans dir (spans.py), reads them out of vLLM's paged cache (paged.py) and copies
them back re-rotated; the client skillcache talks to vLLM with (client.py) and the launcher (launch.py). Nothing here
is imported by the service at start-up unless SKILLCACHE_ENGINE=vllm."""
